"""A one-node Kubernetes on this machine, from the pinned binaries: `python -m e2e.cluster
up|check|run|down` (as root, from the repository root; `make e2e` is `run`).

`up`: the node's network namespace; etcd, kube-apiserver, kube-controller-manager and
kube-scheduler on the host side of its veth; containerd, the kubelet and kube-proxy
inside it; the images imported; CoreDNS. It prints the admin kubeconfig's path
(also `<dir>/kubeconfig`). `down`: stops everything `up` started (even after a crash:
pids are recorded) and removes its containers, mounts, cgroups, namespace and route, so
that `up` can run again. `check`: what a user does with it (`check.py`), on a cluster
`up` made. `run`: up, check, down (`--keep`: no down, to look around). The state lives
in `$SLUICE_E2E_DIR` (/var/tmp/sluice-e2e).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import time

from e2e.cluster import check, dns, images, network, node, procs

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from kube_api import ControlPlane, build_k8s

DEFAULT_DIR = pathlib.Path(os.environ.get("SLUICE_E2E_DIR", "/var/tmp/sluice-e2e"))
API_PORT = 6443
SLUICE_IMAGES = ("local/sluice-operator:dev", "local/sluice-gateway:dev",
                 "local/sluice-engine:dev")
# stopped first: the kubelet would restart what `down` removes
NODE_FIRST = ["kubelet", "kube-proxy"]


def up(base: pathlib.Path, sluice_images: tuple[str, ...] = SLUICE_IMAGES) -> pathlib.Path:
    down(base)
    base.mkdir(parents=True, exist_ok=True)
    build = build_k8s()
    bins = build.build(build.TEST_TIER + build.NODE_TIER)
    network.up()
    node_token, proxy_token = secrets.token_hex(16), secrets.token_hex(16)
    plane = ControlPlane(
        base / "control", address=network.NODE_GATEWAY, port=API_PORT,
        service_cidr=network.SERVICE_CIDR, with_nodes=True,
        tokens={node_token: (f"system:node:{node.NODE_NAME}", "system:nodes"),
                # bound to kube-proxy's rules by the default system:node-proxier binding
                proxy_token: ("system:kube-proxy", "system:node-proxier")})
    (base / "control").mkdir(parents=True, exist_ok=True)
    plane.start()
    plane.start_controllers()
    plane.start_scheduler()
    for name, proc in plane.procs.items():  # for a `down` from another process
        (base / "pids").mkdir(exist_ok=True)
        (base / "pids" / name).write_text(str(proc.pid))
    kubeconfig = base / "kubeconfig"
    shutil.copy(plane.admin_kubeconfig, kubeconfig)

    node.start_containerd(base)
    node.import_image(base, images.build_pause(), node.PAUSE_IMAGE)
    for image in (images.build_coredns(bins), images.build_redis(), *sluice_images):
        t0 = time.monotonic()
        node.import_image(base, image)
        print(f"imported {image} in {time.monotonic() - t0:.0f} s", flush=True)
    node.start_kubelet(base, plane.kubeconfig(node_token, "kubelet"), plane.ca_file,
                       bins / "kubelet")
    node.start_kube_proxy(base, plane.kubeconfig(proxy_token, "kube-proxy"),
                          bins / "kube-proxy")
    _wait(lambda: _kubectl(kubeconfig, "get", "node", node.NODE_NAME, check=False)
          .returncode == 0, 60, "the node registered", base)
    _kubectl(kubeconfig, "wait", "--for=condition=Ready", f"node/{node.NODE_NAME}",
             "--timeout=120s")
    _kubectl(kubeconfig, "apply", "--server-side", "-f", "-",
             input="\n---\n".join(json.dumps(m) for m in dns.manifests(images.COREDNS)))
    _kubectl(kubeconfig, "rollout", "status", "-n", "kube-system", "deployment/coredns",
             "--timeout=180s")
    return kubeconfig


def down(base: pathlib.Path) -> None:
    procs.stop(base, NODE_FIRST)
    node.remove_containers(base)
    procs.stop_all(base, ["containerd", "kube-scheduler", "kube-controller-manager",
                          "kube-apiserver", "etcd"])
    node.remove_cgroups()
    node.clean(base)
    network.down()
    shutil.rmtree(base / "control", ignore_errors=True)


def _kubectl(kubeconfig: pathlib.Path, *args: str, input: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    from k8s_tools import tool

    done = subprocess.run([tool("kubectl"), f"--kubeconfig={kubeconfig}", *args],
                          input=input, text=True, capture_output=True, check=False)
    if check and done.returncode:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done


def _wait(check, timeout: float, what: str, base: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout} s: {what}\n"
                               + procs.log_tail(base, "kubelet"))
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__)
    parser.add_argument("command", choices=["up", "check", "run", "down"])
    parser.add_argument("--dir", type=pathlib.Path, default=DEFAULT_DIR)
    parser.add_argument("--keep", action="store_true", help="run: leave the cluster up")
    args = parser.parse_args()
    t0 = time.monotonic()
    if args.command == "up":
        print(up(args.dir))
    elif args.command == "check":
        check.run(args.dir / "kubeconfig")
    elif args.command == "run":
        try:
            check.run(up(args.dir))
        finally:
            if not args.keep:
                down(args.dir)
    else:
        down(args.dir)
    print(f"{args.command}: {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
