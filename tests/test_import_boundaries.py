"""The picker and the operator never import torch or the engine (their images carry neither)."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
import {modules}
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "sluice.engine")))
assert not bad, bad
"""


@pytest.mark.parametrize("modules", [
    ("sluice.gateway.server.cli, sluice.gateway.server.grpc_server, sluice.gateway.core, "
     "sluice.gateway.discovery.kubernetes, sluice.gateway.envoy.process, sluice.kv_events"),
    "sluice.operator.cli, sluice.operator.handlers, sluice.index_keys",
    "sluice.tokenizer, sluice.default_model",
])
def test_no_torch_no_engine(modules):
    result = subprocess.run([sys.executable, "-c", CHECK.format(modules=modules)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_check_detects_torch():
    result = subprocess.run([sys.executable, "-c", CHECK.format(modules="sluice.engine.config")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
