"""Build pinned Kubernetes binaries from the `k8s.io/kubernetes` Go module, once per machine.

No release download is reachable from the project's machines, but the Go module proxy is,
so the binaries are built the way any module that depends on Kubernetes builds them: a
small module of our own requires `k8s.io/kubernetes` at VERSION and pins each staging
module (`k8s.io/api`, `apimachinery`, ... which Kubernetes' own go.mod replaces with
folders of its repository) to the matching v0.MINOR.PATCH release. The version is
stamped into the binaries as Kubernetes' own build does, so `kubectl version` and helm's
`kubeVersion` checks see the real one.

Cluster DNS comes the same way: the component `coredns` is CoreDNS's own module at
COREDNS_VERSION, built beside them.

Output: `CACHE/VERSION/bin/<component>`; a component already there is not rebuilt.
Usage: `python scripts/build_k8s.py [--components kube-apiserver,...] [--print-bin-dir]`.
The API server alone takes about 5 minutes on 2 cores, the rest 2 more.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

VERSION = "v1.36.3"
COREDNS_VERSION = "v1.14.7"
TEST_TIER = ("kube-apiserver", "kube-controller-manager")
NODE_TIER = ("kube-scheduler", "kubelet", "kube-proxy", "coredns")
DEFAULT_CACHE = pathlib.Path(os.environ.get("SLUICE_K8S_CACHE")
                             or pathlib.Path.home() / ".cache" / "sluice" / "k8s")


def bin_dir(cache: pathlib.Path = DEFAULT_CACHE, version: str = VERSION) -> pathlib.Path:
    return cache / version / "bin"


def _go(*args: str, cwd: pathlib.Path, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["go", *args], cwd=cwd, env=env, check=True, text=True,
                          stdout=subprocess.PIPE).stdout


def _staging_modules(version: str, work: pathlib.Path) -> list[str]:
    """The modules Kubernetes' go.mod replaces with its staging folders."""
    info = json.loads(_go("mod", "download", "-json", f"k8s.io/kubernetes@{version}", cwd=work))
    gomod = pathlib.Path(info["GoMod"]).read_text(encoding="utf-8")
    mods = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", gomod, flags=re.MULTILINE)
    assert mods, "k8s.io/kubernetes go.mod lists no staging replacements"
    return mods


def _module_file(version: str, staging: list[str]) -> str:
    minor_patch = version.removeprefix("v1.")
    pins = "\n".join(f"\t{m} => {m} v0.{minor_patch}" for m in staging)
    return (f"module sluice.dev/k8s-build\n\ngo 1.26\n\n"
            f"require k8s.io/kubernetes {version}\n\nreplace (\n{pins}\n)\n")


def _ldflags(version: str) -> str:
    major, minor = version.removeprefix("v").split(".")[:2]
    stamps = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z"}
    flags = [f"-X {pkg}.{k}={v}" for pkg in ("k8s.io/component-base/version",
                                              "k8s.io/client-go/pkg/version")
             for k, v in stamps.items()]
    return " ".join(["-s", "-w", *flags])


def _build_coredns(out: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(prefix="coredns-build-") as tmp:
        work = pathlib.Path(tmp)
        (work / "go.mod").write_text(f"module sluice.dev/coredns-build\n\ngo 1.26\n\n"
                                     f"require github.com/coredns/coredns {COREDNS_VERSION}\n",
                                     encoding="utf-8")
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
        print(f"building coredns {COREDNS_VERSION} into {out}", file=sys.stderr)
        _go("build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "coredns"),
            "github.com/coredns/coredns", cwd=work, env=env)


def build(components: tuple[str, ...], cache: pathlib.Path = DEFAULT_CACHE,
          version: str = VERSION) -> pathlib.Path:
    out = bin_dir(cache, version)
    missing = [c for c in components if not (out / c).exists()]
    if not missing:
        return out
    out.mkdir(parents=True, exist_ok=True)
    if "coredns" in missing:
        _build_coredns(out)
        missing.remove("coredns")
        if not missing:
            return out
    with tempfile.TemporaryDirectory(prefix="k8s-build-") as tmp:
        work = pathlib.Path(tmp)
        (work / "go.mod").write_text("module sluice.dev/probe\n\ngo 1.26\n", encoding="utf-8")
        staging = _staging_modules(version, work)
        (work / "go.mod").write_text(_module_file(version, staging), encoding="utf-8")
        # CGO off, as Kubernetes' release builds of these components: static binaries.
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
        print(f"building {', '.join(missing)} {version} into {out}", file=sys.stderr)
        _go("build", "-trimpath", "-ldflags", _ldflags(version), "-o", str(out),
            *(f"k8s.io/kubernetes/cmd/{c}" for c in missing), cwd=work, env=env)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--components", default=",".join(TEST_TIER),
                   help=f"comma-separated; the node's are {','.join(NODE_TIER)}")
    p.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    p.add_argument("--version", default=VERSION)
    p.add_argument("--print-bin-dir", action="store_true",
                   help="print the bin folder and build nothing")
    args = p.parse_args()
    if args.print_bin_dir:
        print(bin_dir(args.cache, args.version))
        return
    comps = tuple(c for c in args.components.split(",") if c)
    print(build(comps, args.cache, args.version))


if __name__ == "__main__":
    main()
