"""The node: containerd (Debian's 1.6, CRI), the CNI bridge, the kubelet and kube-proxy,
all inside the node's network namespace (`network.py`).

Workarounds this machine needs, each where it is applied:
- the kubelet refuses cgroup v1 from 1.35 unless told (`failCgroupV1: false`), and this VM
  has cgroup v1;
- containerd 1.6 does not answer the CRI's RuntimeConfig, so the kubelet's own
  `cgroupDriver: cgroupfs` is what both use;
- the VM lacks CAP_SYS_RESOURCE: runc is wrapped to raise negative oomScoreAdj to 0
  (`runc_wrapper.py`);
- no registry is reachable: the pause image is built here (`pause.c`) and every image
  is imported into containerd from the local Docker engine.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time

from e2e.cluster import network, procs

HERE = pathlib.Path(__file__).resolve().parent
NODE_NAME = "sluice-node"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # the name the kubelet and containerd expect
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def containerd_socket(base: pathlib.Path) -> pathlib.Path:
    return base / "containerd" / "containerd.sock"


def ctr(base: pathlib.Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", *_ctr_target(base), *args], capture_output=True,
                          check=check)


def _ctr_target(base: pathlib.Path) -> list[str]:
    return ["--address", str(containerd_socket(base)), "-n", "k8s.io"]


def _containerd_config(base: pathlib.Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{base / 'containerd' / 'root'}"
state = "{base / 'containerd' / 'state'}"
[grpc]
  address = "{containerd_socket(base)}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # the pods' network namespaces under the state folder, which `clean` removes, rather
  # than /var/run/netns, where a killed sandbox would leave them
  netns_mounts_under_state_dir = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "{HERE / 'runc_wrapper.py'}"
[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{base / 'cni' / 'net.d'}"
"""


def _cni_config(base: pathlib.Path) -> dict:
    return {"cniVersion": "0.4.0", "name": "sluice", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
         "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(base / "cni" / "ipam"),
                  "ranges": [[{"subnet": network.POD_CIDR}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "portmap", "capabilities": {"portMappings": True}},
        {"type": "loopback"}]}


def _kubelet_config(base: pathlib.Path, ca_file: pathlib.Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this VM has cgroup v1
        "cgroupDriver": "cgroupfs",  # containerd 1.6 cannot tell the kubelet its driver
        "containerRuntimeEndpoint": f"unix://{containerd_socket(base)}",
        "failSwapOn": False,
        "enforceNodeAllocatable": [],
        # a shared development disk is often fuller than the kubelet's 10 % default
        "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%",
                         "memory.available": "100Mi"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "authentication": {"x509": {"clientCAFile": str(ca_file)},
                           "webhook": {"enabled": False}, "anonymous": {"enabled": False}},
        # only the API server holds a client certificate from this cluster's CA
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [network.CLUSTER_DNS], "clusterDomain": "cluster.local",
        "resolvConf": str(base / "resolv.conf"),
        "serializeImagePulls": False,
        "podCIDR": network.POD_CIDR,
    }


def _kube_proxy_config(kubeconfig: pathlib.Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables", "clusterCIDR": network.POD_CIDR,
        "hostnameOverride": NODE_NAME,
        # leave the host's conntrack table size alone (a VM may refuse the sysctl)
        "conntrack": {"maxPerCore": 0},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
    }


def start_containerd(base: pathlib.Path) -> None:
    for sub in ("containerd", "cni/net.d", "cni/ipam"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "containerd" / "config.toml").write_text(_containerd_config(base))
    (base / "cni" / "net.d" / "10-sluice.conflist").write_text(json.dumps(_cni_config(base)))
    procs.start(base, "containerd", network.in_node(
        "containerd", "--config", str(base / "containerd" / "config.toml")))
    deadline = time.monotonic() + 30
    while ctr(base, "version", check=False).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("containerd did not start:\n" + procs.log_tail(base, "containerd"))
        time.sleep(0.2)


def _reference(image: str) -> str:
    """The full name containerd stores a Docker image under (`local/x:1` is
    `docker.io/local/x:1`, `redis:7` is `docker.io/library/redis:7`)."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." in first or ":" in first or first == "localhost":
        return image
    return f"docker.io/{image}"


def import_image(base: pathlib.Path, image: str, tag: str | None = None) -> None:
    """A Docker image (by name) into the node's containerd, also as `tag` when given;
    streamed from `docker save` (the engine's is ~6 GB)."""
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    imported = subprocess.run(["ctr", *_ctr_target(base), "images", "import", "-"],
                              stdin=save.stdout, capture_output=True, check=False)
    assert save.stdout is not None
    save.stdout.close()
    if save.wait() or imported.returncode:
        raise RuntimeError(f"importing {image}: {imported.stderr.decode()[-500:]}")
    if tag:
        ctr(base, "images", "tag", "--force", _reference(image), tag)


def start_kubelet(base: pathlib.Path, kubeconfig: pathlib.Path, ca_file: pathlib.Path,
                  kubelet: pathlib.Path) -> None:
    (base / "kubelet").mkdir(parents=True, exist_ok=True)
    (base / "resolv.conf").write_text("")  # pods resolve only cluster names
    config = base / "kubelet" / "config.json"
    config.write_text(json.dumps(_kubelet_config(base, ca_file)))
    procs.start(base, "kubelet", network.in_node(
        str(kubelet), f"--config={config}", f"--kubeconfig={kubeconfig}",
        f"--root-dir={base / 'kubelet' / 'root'}", f"--cert-dir={base / 'kubelet' / 'pki'}",
        f"--node-ip={network.NODE_IP}", f"--hostname-override={NODE_NAME}", "--v=1"))


def start_kube_proxy(base: pathlib.Path, kubeconfig: pathlib.Path,
                     kube_proxy: pathlib.Path) -> None:
    config = base / "kube-proxy.json"
    config.write_text(json.dumps(_kube_proxy_config(kubeconfig)))
    procs.start(base, "kube-proxy", network.in_node(str(kube_proxy), f"--config={config}",
                                                   "--v=1"))


def remove_containers(base: pathlib.Path) -> None:
    """Every task containerd runs, killed and deleted, with its container: the shims run
    in sessions of their own and outlive containerd otherwise."""
    if not containerd_socket(base).exists():
        return
    listed = ctr(base, "tasks", "ls", "-q", check=False).stdout.decode().split()
    for task in listed:
        ctr(base, "tasks", "kill", "-s", "SIGKILL", task, check=False)
    deadline = time.monotonic() + 10
    for task in listed:
        while (ctr(base, "tasks", "delete", task, check=False).returncode
               and time.monotonic() < deadline):
            time.sleep(0.2)
    for container in ctr(base, "containers", "ls", "-q", check=False).stdout.decode().split():
        ctr(base, "containers", "delete", container, check=False)


def remove_cgroups() -> None:
    """The kubelet's cgroups (cgroupfs driver: `kubepods` under each v1 hierarchy),
    deepest first: rmdir refuses a cgroup with children."""
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / "kubepods"
        if top.is_dir():
            for cgroup in sorted((p for p in top.rglob("*") if p.is_dir()),
                                 key=lambda p: len(p.parts), reverse=True):
                cgroup.rmdir()
            top.rmdir()


def unmount_under(folder: pathlib.Path) -> None:
    """Mounts the kubelet and containerd left under `folder` (volumes, rootfs, shm)."""
    mounts = [line.split()[1] for line in pathlib.Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(str(folder))), reverse=True):
        subprocess.run(["umount", "-l", mount], check=False)


def clean(base: pathlib.Path) -> None:
    unmount_under(base)
    for sub in ("containerd", "kubelet", "cni"):
        shutil.rmtree(base / sub, ignore_errors=True)
