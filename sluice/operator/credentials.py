"""How the operator logs in, for both of its clients.

Ours (`kube.KubeClient`) uses the `Configuration` that `sluice.kube_config.load` reads:
the ServiceAccount in a pod (its rotating token re-read every minute), else the
kubeconfig. kopf logs in through its login handler, which returns `kopf_connection()`:
the same server and CA, and the token as the configuration holds it now. kopf calls the
handler at start and again after any 401. Tokens are never logged.
"""

from __future__ import annotations

import kopf
from kubernetes_asyncio import client as k8s

from sluice.kube_config import SA_DIR, in_cluster, load

__all__ = ["SA_DIR", "in_cluster", "kopf_connection", "load"]


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
