"""The node's network: a network namespace of its own, joined to the host by a veth pair.

Only loopback and namespaces our scripts create may receive traffic, and pod and Service
addresses (private ranges) must never be routable out of the machine. So the node
(containerd, the kubelet, kube-proxy and every pod) lives in the namespace `NETNS`:

    host  NODE_GATEWAY/30 --veth-- NODE_IP/30  node namespace: bridge cni0 POD_CIDR,
                                               kube-proxy's rules for SERVICE_CIDR

The namespace has no default route: a pod reaches the API server (on NODE_GATEWAY) and
its own pods, nothing else. The host routes POD_CIDR to the node, so the API server can
reach pods (port-forward goes through the kubelet, which needs NODE_IP instead).
"""

from __future__ import annotations

import subprocess

NETNS = "sluice-node"
HOST_VETH, NODE_VETH = "sluice-h0", "sluice-n0"
NODE_GATEWAY, NODE_IP = "10.250.0.1", "10.250.0.2"
POD_CIDR = "10.244.0.0/24"
SERVICE_CIDR = "10.96.0.0/24"
CLUSTER_DNS = "10.96.0.10"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def in_node(*argv: str) -> list[str]:
    """`argv` run inside the node's network namespace, and only that: `ip netns exec`
    would also give it a mount namespace with a fresh /sys, where the kubelet and runc
    find no cgroup mounts."""
    return ["nsenter", f"--net=/var/run/netns/{NETNS}", "--", *argv]


def exists() -> bool:
    return NETNS in sh("ip", "netns", "list").stdout.split()


def up() -> None:
    if exists():
        down()
    sh("ip", "netns", "add", NETNS)
    sh("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NODE_VETH)
    sh("ip", "link", "set", NODE_VETH, "netns", NETNS)
    sh("ip", "addr", "add", f"{NODE_GATEWAY}/30", "dev", HOST_VETH)
    sh("ip", "link", "set", HOST_VETH, "up")
    for argv in (("ip", "addr", "add", f"{NODE_IP}/30", "dev", NODE_VETH),
                 ("ip", "link", "set", NODE_VETH, "up"),
                 ("ip", "link", "set", "lo", "up"),
                 # kube-proxy's rules must see bridged pod-to-pod traffic, and the node
                 # forwards between the bridge and the veth
                 ("sysctl", "-qw", "net.ipv4.ip_forward=1"),
                 ("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"),
                 # kube-proxy answers Service IPs on the node itself through loopback
                 ("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1")):
        sh(*in_node(*argv))
    sh("ip", "route", "replace", POD_CIDR, "via", NODE_IP, "dev", HOST_VETH)


def down() -> None:
    """Remove the namespace (its interfaces, bridge and iptables rules go with it) and the
    host's route to the pods. Safe to run when nothing is there."""
    sh("ip", "route", "del", POD_CIDR, check=False)
    if exists():
        sh("ip", "netns", "delete", NETNS)
    sh("ip", "link", "delete", HOST_VETH, check=False)
