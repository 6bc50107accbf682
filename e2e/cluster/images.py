"""The images a one-node cluster needs beyond Sluice's three, made here: no registry is
reachable. Each is built in the local Docker engine (`scripts/images.sh` starts it and
makes the `local/debian:bookworm` base), then imported into the node's containerd.

- pause: `pause.c`, static, alone in the image (the sandbox of every pod);
- coredns: the binary `scripts/build_k8s.py` builds, alone in the image (cluster DNS);
- redis: Debian's redis-server on the local base (the chart's in-cluster Redis);
- envoy: the gateway image carries Envoy at the path the chart runs (`values.yaml`
  points `envoy.image` at it), so it is not built apart.
"""

from __future__ import annotations

import io
import pathlib
import subprocess
import tarfile
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PAUSE = "local/pause:e2e"
COREDNS = "local/coredns:e2e"
REDIS = "local/redis:e2e"
BASE = "local/debian:bookworm"


def _import_single_binary(binary: pathlib.Path, name: str, image: str) -> None:
    """An image holding one static executable at /`name`, its entrypoint."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tar.gettarinfo(str(binary), arcname=name)
        info.uid = info.gid = 0
        info.mode = 0o755
        with binary.open("rb") as f:
            tar.addfile(info, f)
    subprocess.run(["docker", "import", "--change", f'ENTRYPOINT ["/{name}"]',
                    "--change", "USER 65532", "-", image],
                   input=buf.getvalue(), check=True, capture_output=True)


def build_pause() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        binary = pathlib.Path(tmp) / "pause"
        subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(HERE / "pause.c")],
                       check=True)
        _import_single_binary(binary, "pause", PAUSE)
    return PAUSE


def build_coredns(bin_dir: pathlib.Path) -> str:
    _import_single_binary(bin_dir / "coredns", "coredns", COREDNS)
    return COREDNS


def build_redis() -> str:
    dockerfile = (f"FROM {BASE}\n"
                  "RUN apt-get update && apt-get install -y --no-install-recommends "
                  "redis-server redis-tools && rm -rf /var/lib/apt/lists/*\n"
                  "WORKDIR /data\nUSER 65532\n")
    subprocess.run(["docker", "build", "--network", "host", "-t", REDIS, "-"],
                   input=dockerfile.encode(), check=True, capture_output=True,
                   env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/local/bin:/usr/bin:/bin"})
    return REDIS
