"""The operator's Kubernetes client: `kubernetes_asyncio`, the official client's asyncio
port, over the resources the operator reads and writes.

kopf brings its own client for watching and for patching the objects it handles; this
one applies, patches and deletes children and writes pool status. Children are written
with server-side apply under the field manager `sluice-operator`, so the API server
merges our fields with everyone else's and says who owns what (`managedFields`); other
writes carry the same field manager.

Errors split in two (`is_transient`): what may pass if asked again (409, 429, 5xx, a lost
connection, a timeout) is retried with backoff; what the API server refused for good
(400, 403, 404 on a create, 422) becomes a Degraded condition with its message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s

from sluice import labels

FIELD_MANAGER = labels.OPERATOR_NAME
USER_AGENT = f"{labels.OPERATOR_NAME}/0.1.0"
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON


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
    """409: AlreadyExists on create, a stale resourceVersion, or an apply conflict."""


# A request that never got an answer: the connection failed, or no answer came in time.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def is_transient(error: BaseException) -> bool:
    """Worth another try: a conflict, throttling, an API server or network failure."""
    if isinstance(error, TRANSPORT_ERRORS):
        return True
    return isinstance(error, ApiError) and (error.status in (409, 429) or error.status >= 500)


def _api_error(e: k8s.ApiException) -> ApiError:
    try:
        body = json.loads(e.body or b"{}")
    except ValueError:
        body = {}
    status = int(e.status or 0)
    reason = str(body.get("reason") or e.reason or "")
    message = str(body.get("message") or (e.body or b"")[:200])
    cls = {404: NotFound, 409: Conflict}.get(status, ApiError)
    return cls(status, reason, message)


class KubeClient:
    """Reads and writes by `ResourceRef`. One instance per operator process."""

    def __init__(self, api: k8s.ApiClient, field_manager: str = FIELD_MANAGER,
                 timeout_s: float = 30.0):
        self._api, self.field_manager, self.timeout_s = api, field_manager, timeout_s
        api.user_agent = USER_AGENT

    @classmethod
    def from_configuration(cls, configuration: k8s.Configuration,
                           field_manager: str = FIELD_MANAGER) -> KubeClient:
        # Up to 16 reconcile passes run at once (Reconciler.max_concurrent) plus the loop:
        # keep that many connections alive, so none waits for another's.
        configuration.connection_pool_maxsize = 24
        return cls(k8s.ApiClient(configuration), field_manager)

    async def close(self) -> None:
        await self._api.close()

    async def _call(self, method: str, path: str, *, query: list[tuple[str, Any]] | None = None,
                    body: Any = None, content_type: str = "application/json") -> Any:
        try:
            return await self._api.call_api(
                path, method, query_params=query or [],
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body, response_types_map={200: "object", 201: "object", 202: "object"},
                auth_settings=["BearerToken"], _return_http_data_only=True,
                _request_timeout=self.timeout_s)
        except k8s.ApiException as e:
            raise _api_error(e) from None

    def _manager(self) -> list[tuple[str, Any]]:
        return [("fieldManager", self.field_manager)]

    async def get(self, ref: ResourceRef, namespace: str | None, name: str,
                  subresource: str | None = None) -> dict[str, Any]:
        return await self._call("GET", ref.path(namespace, name, subresource))

    async def list(self, ref: ResourceRef, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector)] if label_selector else []
        body = await self._call("GET", ref.path(namespace), query=query)
        return list(body.get("items") or [])

    async def create(self, ref: ResourceRef, namespace: str | None,
                     body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("POST", ref.path(namespace), query=self._manager(), body=body)

    async def apply(self, ref: ResourceRef, namespace: str | None,
                    body: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of `body` (the fields this manager owns), taking over fields
        another manager set (`force`: the operator is the authority on its children)."""
        query = [*self._manager(), ("force", "true")]
        return await self._call("PATCH", ref.path(namespace, body["metadata"]["name"]),
                                query=query, body=body, content_type=APPLY_PATCH)

    async def patch(self, ref: ResourceRef, namespace: str | None, name: str,
                    patch: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386)."""
        return await self._call("PATCH", ref.path(namespace, name, subresource),
                                query=self._manager(), body=patch, content_type=MERGE_PATCH)

    async def replace(self, ref: ResourceRef, namespace: str | None, name: str,
                      body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: full replacement; 409 when body's metadata.resourceVersion is stale."""
        return await self._call("PUT", ref.path(namespace, name), query=self._manager(),
                                body=body)

    async def delete(self, ref: ResourceRef, namespace: str | None, name: str) -> None:
        try:
            await self._call("DELETE", ref.path(namespace, name),
                             body={"propagationPolicy": "Background"})
        except NotFound:
            pass
