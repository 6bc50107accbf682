"""Cluster DNS: CoreDNS in kube-system behind the Service the kubelet gives pods
(`network.CLUSTER_DNS`), as kubeadm deploys it. It answers only cluster names: the node
has no way out, so nothing is forwarded. It listens on 1053 as a non-root user; the
Service maps port 53 there."""

from __future__ import annotations

from typing import Any

from e2e.cluster import network

COREFILE = """.:1053 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loop
    reload
}
"""
LABELS = {"k8s-app": "kube-dns"}


def manifests(image: str) -> list[dict[str, Any]]:
    meta = {"name": "coredns", "namespace": "kube-system"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns"},
         "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", **meta}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
         "data": {"Corefile": COREFILE}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {**meta, "labels": LABELS},
         "spec": {"replicas": 1, "selector": {"matchLabels": LABELS}, "template": {
             "metadata": {"labels": LABELS},
             "spec": {"serviceAccountName": "coredns", "dnsPolicy": "Default",
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                      "containers": [{
                          "name": "coredns", "image": image, "imagePullPolicy": "Never",
                          "args": ["-conf", "/etc/coredns/Corefile"],
                          "ports": [{"name": "dns", "containerPort": 1053, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 1053,
                                     "protocol": "TCP"}],
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}},
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                          "securityContext": {"readOnlyRootFilesystem": True,
                                              "allowPrivilegeEscalation": False,
                                              "capabilities": {"drop": ["ALL"]}},
                          "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns"}]}],
                      "volumes": [{"name": "config", "configMap": {"name": "coredns"}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": LABELS},
         "spec": {"selector": LABELS, "clusterIP": network.CLUSTER_DNS,
                  "ports": [{"name": "dns", "port": 53, "targetPort": 1053, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "targetPort": 1053,
                             "protocol": "TCP"}]}},
    ]
