"""Where a Sluice component finds its Kubernetes cluster and identity, for the operator and
the picker alike: kubernetes_asyncio's loaders.

- In a pod, the ServiceAccount. The kubelet replaces the projected token file before the
  token expires (at 80 % of its lifetime: an hour by default, so the old one is refused
  some 12 minutes later); the in-cluster loader re-reads the file every minute, so a
  token read once at start never outlives its rotation.
- Elsewhere, the kubeconfig (`$KUBECONFIG`, `~/.kube/config` or the path given).

Tokens are never logged.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

SA_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")


class _InClusterLoader(InClusterConfigLoader):
    """The in-cluster loader, with the token trimmed as client-go trims it: a token file
    written by hand (`kubectl create token > token`) ends in a newline, which would
    otherwise reach the Authorization header and fail every request."""

    def _read_token_file(self) -> None:
        super()._read_token_file()
        self.token = self.token.rstrip()


def in_cluster(sa_dir: pathlib.Path = SA_DIR, environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get("KUBERNETES_SERVICE_HOST")) and (sa_dir / "token").exists()


async def load(kubeconfig: str | os.PathLike[str] | None = None, *,
               sa_dir: pathlib.Path = SA_DIR,
               environ: Mapping[str, str] = os.environ) -> k8s.Configuration:
    """The ServiceAccount's configuration in a pod, else the kubeconfig's (`kubeconfig`
    given: that file's, in a pod too)."""
    configuration = k8s.Configuration()
    if kubeconfig is None and in_cluster(sa_dir, environ):
        _InClusterLoader(str(sa_dir / "token"), str(sa_dir / "ca.crt"),
                              environ=dict(environ)).load_and_set(configuration)
    else:
        await k8s_config.load_kube_config(
            config_file=None if kubeconfig is None else os.fspath(kubeconfig),
            client_configuration=configuration, persist_config=False)
    return configuration
