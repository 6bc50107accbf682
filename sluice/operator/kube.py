"""A small async Kubernetes REST client (httpx) for the operator's own reads and writes.

kopf brings its own client for watching and for patching the objects it handles;
this one creates, patches and deletes children and writes pool status. It uses the
connection kopf logged in with (`kopf.ConnectionInfo`), so both agree on the cluster.
Writes are JSON merge patches (RFC 7386) carrying `metadata.resourceVersion` when the
caller wants optimistic concurrency; the API server answers 409 on a stale version.
Bearer tokens are never logged; a ServiceAccount token is re-read as it rotates
(`credentials.py`).

Errors split in two (`is_transient`): what may pass if asked again (409, 429, 5xx, a lost
connection) is retried with backoff; what the API server refused for good (400, 403, 404
on a create, 422) becomes a Degraded condition with its message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

MERGE_PATCH = "application/merge-patch+json"
USER_AGENT = "sluice-operator/0.1.0"


@dataclass(frozen=True)
class ResourceRef:
    """group/version/plural of a resource; `group` is "" for the core API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        root = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        ns = f"/namespaces/{namespace}" if self.namespaced and namespace else ""
        tail = f"/{name}" if name else ""
        sub = f"/{subresource}" if subresource else ""
        return f"{root}{ns}/{self.plural}{tail}{sub}"


DEPLOYMENTS = ResourceRef("apps", "v1", "deployments")
SERVICES = ResourceRef("", "v1", "services")
PDBS = ResourceRef("policy", "v1", "poddisruptionbudgets")
PODS = ResourceRef("", "v1", "pods")
PVCS = ResourceRef("", "v1", "persistentvolumeclaims")
POOLS = ResourceRef("sluice.dev", "v1alpha1", "inferencepools")
GIE_POOLS = ResourceRef("inference.networking.k8s.io", "v1", "inferencepools")
EVENTS = ResourceRef("", "v1", "events")
CLUSTER_PEERINGS = ResourceRef("kopf.dev", "v1", "clusterkopfpeerings", namespaced=False)
PEERINGS = ResourceRef("kopf.dev", "v1", "kopfpeerings")

# The kinds the operator applies as a pool's children ("InferencePool" there is GIE's:
# our own pool is never a child).
BY_KIND: dict[str, ResourceRef] = {
    "Deployment": DEPLOYMENTS, "Service": SERVICES, "PodDisruptionBudget": PDBS,
    "InferencePool": GIE_POOLS,
}


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    """409: AlreadyExists on create, or a stale resourceVersion on update."""


def is_transient(error: BaseException) -> bool:
    """Worth another try: a conflict, throttling, an API server or network failure."""
    if isinstance(error, httpx.TransportError):
        return True
    return isinstance(error, ApiError) and (error.status in (409, 429) or error.status >= 500)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {}
    reason = str(body.get("reason") or response.reason_phrase)
    message = str(body.get("message") or response.text[:200])
    cls = {404: NotFound, 409: Conflict}.get(response.status_code, ApiError)
    raise cls(response.status_code, reason, message)


class KubeClient:
    """CRUD on namespaced resources. One instance per operator process."""

    def __init__(self, http: httpx.AsyncClient):
        self._http = http

    @classmethod
    def from_connection(cls, info: Any, timeout: float = 30.0,
                        auth: httpx.Auth | None = None) -> KubeClient:
        """Build from a `kopf.ConnectionInfo` (server, CA, token or client certificate);
        kopf turns it into TLS settings and auth headers the same way for its own client.
        `auth` (a rotating token, `credentials.TokenAuth`) replaces the info's token."""
        verify: Any = info.as_ssl_context() if info.server.startswith("https") else True
        # Up to 16 reconcile passes run at once (Reconciler.max_concurrent) plus the loop:
        # keep that many connections alive (no connect per request), and no more (httpx
        # scans its pool on every request).
        limits = httpx.Limits(max_connections=24, max_keepalive_connections=24)
        headers = {**(info.as_http_headers() if auth is None else {}), "User-Agent": USER_AGENT}
        http = httpx.AsyncClient(base_url=info.server, verify=verify, limits=limits,
                                 headers=headers, timeout=timeout, auth=auth)
        return cls(http)

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._http.request(method, path, **kwargs)
        _raise_for(response)
        return response.json() if response.content else {}

    async def get(self, ref: ResourceRef, namespace: str | None, name: str,
                  subresource: str | None = None) -> dict[str, Any]:
        return await self._request("GET", ref.path(namespace, name, subresource))

    async def list(self, ref: ResourceRef, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else {}
        body = await self._request("GET", ref.path(namespace), params=params)
        return list(body.get("items") or [])

    async def create(self, ref: ResourceRef, namespace: str | None,
                     body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", ref.path(namespace), json=body)

    async def patch(self, ref: ResourceRef, namespace: str | None, name: str,
                    patch: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        return await self._request("PATCH", ref.path(namespace, name, subresource),
                                   json=patch, headers={"Content-Type": MERGE_PATCH})

    async def replace(self, ref: ResourceRef, namespace: str | None, name: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: full replacement; 409 when body's metadata.resourceVersion is stale."""
        return await self._request("PUT", ref.path(namespace, name), json=body)

    async def delete(self, ref: ResourceRef, namespace: str | None, name: str) -> None:
        try:
            await self._request("DELETE", ref.path(namespace, name),
                                json={"propagationPolicy": "Background"})
        except NotFound:
            pass
