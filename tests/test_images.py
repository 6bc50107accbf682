"""The three images: Dockerfiles any builder reads (no BuildKit, no `# syntax` frontend), and,
where a Docker engine runs and `scripts/images.sh build` made the images, smoke tests of them.

The smoke tests run each container the way the chart runs its pod (read-only root, no
capabilities, the pod's writable emptyDirs as tmpfs), as a user the image does not know
(65532), and with no network at all: requests come from inside the engine container's own
network namespace (`docker exec`), which the gateway containers join. Images:
$SLUICE_IMAGE_PREFIX/sluice-{operator,gateway,engine}:$SLUICE_IMAGE_TAG (local/…:dev).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILES = {"operator": "operator/Dockerfile", "gateway": "gateway/Dockerfile",
               "engine": "engine_image/Dockerfile"}
PREFIX = os.environ.get("SLUICE_IMAGE_PREFIX", "local")
TAG = os.environ.get("SLUICE_IMAGE_TAG", "dev")
# A uid with no passwd entry and no file in the image, as OpenShift assigns them: stricter
# than the chart's 10001, which owns the engine image's home folder.
USER = "65532:65532"
# The engine's start on a loaded 2-core machine: torch import, model load.
ENGINE_START_S = 600
# Flags that need BuildKit (and `RUN <<EOF` heredocs): the classic builder rejects them.
BUILDKIT_ONLY = re.compile(r"^\s*(RUN|COPY|ADD)\b.*(--mount|--link|--chmod|--network|--security"
                           r"|--checksum|--parents|--exclude|--keep-git-dir|<<)", re.MULTILINE)


def image(name: str) -> str:
    return f"{PREFIX}/sluice-{name}:{TAG}"


# Static checks: always run.

@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_needs_no_buildkit_and_no_frontend_image(name):
    text = (ROOT / DOCKERFILES[name]).read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    assert not re.search(r"^#\s*(check|escape)\s*=", text, re.MULTILINE | re.IGNORECASE)
    assert not BUILDKIT_ONLY.search(text)


def _patterns(path: pathlib.Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_classic_builders_dockerignore_is_each_dockerfiles(name):
    """The classic builder reads only the context root's .dockerignore; BuildKit reads the
    one next to the Dockerfile first. Both must send the same context."""
    own = ROOT / f"{DOCKERFILES[name]}.dockerignore"
    assert _patterns(ROOT / ".dockerignore") == _patterns(own)


def test_the_gateway_image_carries_the_charts_envoy_release():
    text = (ROOT / DOCKERFILES["gateway"]).read_text()
    version = re.search(r"^ARG ENVOY_VERSION=(\S+)$", text, re.MULTILINE).group(1)
    values = yaml.safe_load((ROOT / "charts/sluice/values.yaml").read_text())
    assert values["envoy"]["image"]["tag"].endswith(f"-v{version}")


def test_the_scripts_parse_and_use_the_classic_builder():
    for script in ("scripts/images.sh", "e2e/run.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)
        assert "DOCKER_BUILDKIT=0" in (ROOT / script).read_text(), script


# Smoke tests: a Docker engine and the built images.

def _docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


def _engine_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return _docker("info", check=False, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker() -> None:
    if not _engine_runs():
        pytest.skip("no Docker engine answers (scripts/images.sh build starts one)")


def _need(name: str) -> str:
    if _docker("image", "inspect", image(name), check=False).returncode != 0:
        pytest.skip(f"no image {image(name)} (scripts/images.sh build)")
    return image(name)


def _restricted(network: str = "none") -> list[str]:
    """The chart's container securityContext (Pod Security `restricted`) as docker flags."""
    return ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--user", USER, "--network", network]


@pytest.mark.slow
@pytest.mark.parametrize("name,argv", [
    ("operator", ["operator", "--help"]),
    ("gateway", ["epp", "--help"]),
    ("engine", ["engine", "--help"]),
])
def test_entrypoint_starts(docker, name, argv):
    ref = _need(name)
    out = _docker("run", "--rm", *_restricted(), "--tmpfs", "/tmp", ref, *argv).stdout
    assert out.startswith(f"usage: sluice {argv[0]}")


@pytest.mark.slow
def test_the_gateway_image_runs_envoy(docker):
    ref = _need("gateway")
    out = _docker("run", "--rm", *_restricted(), "--entrypoint", "/usr/local/bin/envoy", ref,
                  "--version").stdout
    assert re.search(r"envoy\s+version: \S+/1\.\d+\.\d+/", out)


def _quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * 1024 ** " KMGT".index((unit or " ")[0])


def pod_run_args(pool_file: pathlib.Path, engine_image: str) -> tuple[list[str], list[str]]:
    """(docker run flags, image + argv) of the engine pod the operator renders for a pool:
    its command, env, emptyDir mounts and memory limit. $(POD_IP) is 127.0.0.1, the pod's
    own address in its network namespace."""
    # imported here, so the static checks run where the operator package does not import
    from sluice.operator import render, spec

    pool = spec.PoolSpec.from_body(yaml.safe_load(pool_file.read_text()))
    config = render.RenderConfig(engine_image=engine_image)
    pod = render.render_pod_template(pool, pool.roles[0], config)["spec"]
    (container,) = pod["containers"]
    assert "initContainers" not in pod  # the built-in model: nothing to fetch
    volumes = {v["name"]: v for v in pod["volumes"]}
    flags = _restricted()
    for mount in container["volumeMounts"]:
        assert "emptyDir" in volumes[mount["name"]], mount  # the pool's only volumes
        # noexec (Docker's default): no code is built or loaded there
        flags += ["--tmpfs", f"{mount['mountPath']}:mode=0777"]
    env: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = "127.0.0.1"
    for name, value in env.items():
        flags += ["-e", f"{name}={value}"]
    memory = container["resources"].get("limits", {}).get("memory")
    if memory:
        flags += ["--memory", str(_quantity_bytes(memory))]
    command, *rest = container["command"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
            for a in rest + container["args"]]
    return [*flags, "--entrypoint", command], [container["image"], *args]


def _exec_python(container: str, code: str, timeout: float = 120) -> str:
    return _docker("exec", container, "python", "-c", code, timeout=timeout).stdout


HTTP = """
import json, sys, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() or None,
                             headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        print(json.dumps({"status": r.status, "headers": dict(r.headers),
                          "body": r.read().decode()}))
except OSError as exc:
    print(json.dumps({"status": getattr(exc, "code", 0), "error": str(exc)}))
"""


def _http(container: str, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    out = _docker("exec", container, "python", "-c", HTTP, url,
                  json.dumps(body) if body is not None else "", timeout=180).stdout
    return json.loads(out)


def _wait_http(container: str, url: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        state = _docker("inspect", "-f", "{{.State.Running}}", container).stdout.strip()
        if state != "true":
            logs = _docker("logs", "--tail", "60", container, check=False)
            pytest.fail(f"{container} exited:\n{logs.stdout}{logs.stderr}")
        if _http(container, url)["status"] == 200:
            return
        if time.monotonic() > deadline:
            logs = _docker("logs", "--tail", "60", container, check=False)
            pytest.fail(f"{url} not ready in {deadline_s} s:\n{logs.stdout}{logs.stderr}")
        time.sleep(1)


@pytest.fixture(scope="module")
def engine_container(docker) -> Iterator[str]:
    """The engine pod of charts/sluice/examples/pool-cpu.yaml (the built-in default model)."""
    ref = _need("engine")
    flags, argv = pod_run_args(ROOT / "charts/sluice/examples/pool-cpu.yaml", ref)
    name = f"sluice-smoke-engine-{os.getpid()}"
    _docker("run", "-d", "--name", name, *flags, *argv)
    try:
        _wait_http(name, "http://127.0.0.1:8000/health", ENGINE_START_S)
        yield name
    finally:
        _docker("rm", "-f", name, check=False)


COMPLETION = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
              "max_tokens": 8, "temperature": 0}


@pytest.mark.slow
def test_the_engine_serves_the_default_model_read_only(engine_container):
    reply = _http(engine_container, "http://127.0.0.1:8000/v1/completions", COMPLETION)
    assert reply["status"] == 200, reply
    body = json.loads(reply["body"])
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_the_engine_runs_the_cpu_kernels_installed_in_the_image(engine_container):
    """The kernels were built with the image (setup.py), not at the pod's start: the best
    variant this CPU runs loads from the read-only image, and nothing was written to /tmp."""
    out = _exec_python(engine_container, (
        "import os, torch, sluice.engine._C; print(torch.ops.sluice.cpu_isa(), "
        "sluice.engine._C.__file__.startswith('/opt/sluice/'), os.listdir('/tmp'))"))
    isa, in_image, tmp = out.split(" ", 2)
    assert isa in ("portable", "avx2", "avx512", "avx512bf16") and in_image == "True", out
    assert ".cache" not in tmp, out


@pytest.fixture(scope="module")
def gateway_containers(engine_container) -> Iterator[str]:
    """The picker and Envoy (each as the chart runs it, in the engine's network namespace:
    loopback only), Envoy's config written by the bootstrap the chart's initContainer runs."""
    ref = _need("gateway")
    shared = [*_restricted(f"container:{engine_container}"), "--tmpfs", "/tmp"]
    picker, envoy = (f"sluice-smoke-{n}-{os.getpid()}" for n in ("picker", "envoy"))
    bootstrap = ("python -m sluice.gateway.envoy.bootstrap --listen-port=8080 "
                 "--admin-host=127.0.0.1 --admin-port=9901 --picker-host=127.0.0.1 "
                 "--picker-port=9002 --eds --out=/etc/envoy/envoy.yaml "
                 "&& exec /usr/local/bin/envoy --config-path /etc/envoy/envoy.yaml "
                 "--concurrency 1 --log-level info --disable-hot-restart")
    try:
        _docker("run", "-d", "--name", picker, *shared, "-e", "PYTHONDONTWRITEBYTECODE=1", ref,
                "epp", "--host=127.0.0.1", "--grpc-port=9002", "--metrics-port=9090",
                "--discovery=static", "--routing=kv_aware",
                "--engine=http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,"
                "replay=tcp://127.0.0.1:5558,model=smollm2-135m-instruct")
        _docker("run", "-d", "--name", envoy, *shared, "--tmpfs", "/etc/envoy",
                "--entrypoint", "sh", ref, "-c", bootstrap)
        _wait_http(picker, "http://127.0.0.1:9090/metrics", 120)
        yield envoy
    finally:
        for name in (envoy, picker):
            _docker("rm", "-f", name, check=False)


@pytest.mark.slow
def test_a_completion_through_envoy_and_the_picker(engine_container, gateway_containers):
    deadline = time.monotonic() + 60
    while True:  # Envoy opens its listener once its clusters are initialised
        reply = _http(engine_container, "http://127.0.0.1:8080/v1/completions", COMPLETION)
        if reply["status"] == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert reply["status"] == 200, (reply, _docker("logs", "--tail", "40", gateway_containers,
                                                   check=False).stderr)
    headers = {k.lower(): v for k, v in reply["headers"].items()}
    assert "127.0.0.1:8000" in headers["x-sluice-pod"]
    assert json.loads(reply["body"])["choices"][0]["text"]
