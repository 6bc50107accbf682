"""`sluice operator` flags, and the operator's import graph stays free of torch, the
engine and the gateway (its image has none of them)."""

from __future__ import annotations

import subprocess
import sys

from sluice.cli import build_parser
from sluice.operator.cli import config_from_args


def test_flags_map_to_the_frozen_config():
    argv = ["operator", "-n", "team-a", "-n", "team-b", "--engine-image", "e:1",
            "--vllm-image", "v:2", "--redis-url", "redis://r:6379/0", "--standalone",
            "--autoscale-interval", "5", "--liveness", ""]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert config.namespaces == ("team-a", "team-b") and not config.clusterwide
    assert config.render.engine_image == "e:1" and config.render.vllm_image == "v:2"
    assert config.redis_url == "redis://r:6379/0" and config.standalone
    assert config.autoscale_interval_s == 5.0 and config.liveness_endpoint is None
    default = config_from_args(build_parser(["operator"]).parse_args(["operator"]))
    assert default.clusterwide and default.peering_name == "sluice"
    # replicas must not tie on peering priority (kopf pauses every operator on a tie)
    other = config_from_args(build_parser(["operator"]).parse_args(["operator"]))
    assert default.priority != other.priority and default.priority > 0
    argv = ["operator", "--priority", "5"]
    assert config_from_args(build_parser(argv).parse_args(argv)).priority == 5


def test_operator_imports_no_torch_engine_or_gateway():
    code = ("import sys, sluice.operator.cli, sluice.operator.runtime, sluice.operator.bench\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch'\n"
            "       or m.startswith(('sluice.engine', 'sluice.gateway'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_engine_key_comes_from_the_environment_and_is_never_printed(monkeypatch):
    monkeypatch.setenv("SLUICE_ENGINE_API_KEY", "sk-engine-secret")
    config = config_from_args(build_parser(["operator"]).parse_args(["operator"]))
    assert config.engine_api_key == "sk-engine-secret"
    assert "sk-engine-secret" not in repr(config)
    monkeypatch.delenv("SLUICE_ENGINE_API_KEY")
    assert config_from_args(build_parser(["operator"]).parse_args(["operator"])
                            ).engine_api_key is None
