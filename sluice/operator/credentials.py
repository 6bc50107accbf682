"""How the operator logs in, for both of its clients.

kubernetes_asyncio's loaders read the credentials into a `Configuration`:
- in a pod, the ServiceAccount. The kubelet replaces the projected token file before the
  token expires (at 80 % of its lifetime: an hour by default, so the old one is refused
  some 12 minutes later); the in-cluster loader re-reads the file every minute, so a
  token read once at start never outlives its rotation;
- elsewhere, the kubeconfig (`$KUBECONFIG`, `~/.kube/config` or the path given).

kopf logs in through its login handler, which returns `kopf_connection()`: the same
server and CA, and the token as the configuration holds it now. kopf calls the handler
at start and again after any 401. Tokens are never logged.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import kopf
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader

SA_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster(sa_dir: pathlib.Path = SA_DIR, environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get("KUBERNETES_SERVICE_HOST")) and (sa_dir / "token").exists()


async def load(kubeconfig: str | os.PathLike[str] | None = None, *,
               sa_dir: pathlib.Path = SA_DIR,
               environ: Mapping[str, str] = os.environ) -> k8s.Configuration:
    """The ServiceAccount's configuration in a pod, else the kubeconfig's."""
    configuration = k8s.Configuration()
    if kubeconfig is None and in_cluster(sa_dir, environ):
        InClusterConfigLoader(str(sa_dir / "token"), str(sa_dir / "ca.crt"),
                              environ=dict(environ)).load_and_set(configuration)
    else:
        await k8s_config.load_kube_config(
            config_file=None if kubeconfig is None else os.fspath(kubeconfig),
            client_configuration=configuration, persist_config=False)
    return configuration


async def kopf_connection(configuration: k8s.Configuration) -> kopf.ConnectionInfo:
    """kopf's `ConnectionInfo` for the same cluster and identity; the token is the one the
    configuration holds now (its refresh hook runs first)."""
    auth = (await configuration.auth_settings()).get("BearerToken") or {}
    scheme, _, token = str(auth.get("value") or "").partition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host, ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=configuration.cert_file, private_key_path=configuration.key_file)
