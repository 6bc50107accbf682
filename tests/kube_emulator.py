"""kmock's `KubernetesEmulator` extended towards a real API server, for operator tests.

kmock provides the HTTP server, request parsing, API discovery and error rendering.
This subclass replaces its object handling with `k8s_store.Store` (resourceVersion,
uid, generation, status/scale subresources, 409 conflicts, label selectors,
finalizers, garbage collection, watches from a resourceVersion), validates custom
resources like the CRD schema would (`validators`), renders `Table` responses for
`kubectl get`, can inject failures (`fail_next`), and authenticates bearer tokens when
given the ones it accepts (`tokens`), as a token's expiry or rotation would.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock
from k8s_store import ApiError, Kind, Store, selector_matches

VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]

BUILTIN_KINDS = [
    Kind("apps", "v1", "deployments", "Deployment", True, ("status", "scale"),
         ("spec.replicas", "status.replicas", "status.selector")),
    Kind("", "v1", "services", "Service", True, ("status",)),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",)),
    Kind("", "v1", "pods", "Pod", True, ("status",)),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("status",)),
    Kind("", "v1", "secrets", "Secret", True),
    Kind("", "v1", "events", "Event", True),
    Kind("events.k8s.io", "v1", "events", "Event", True),
    Kind("", "v1", "namespaces", "Namespace", False),
    Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions",
         "CustomResourceDefinition", False, ("status",)),
]


@dataclass
class Fault:
    method: str
    plural: str
    status: int
    count: int
    message: str | None = None
    reason: str = "Injected"


class ApiServerEmulator(kmock.KubernetesEmulator):
    """Use as `async with ApiServerEmulator() as api, kmock.Server(api): ...`."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = Store()
        self.faults: list[Fault] = []
        self.printer_columns: dict[str, list[dict[str, Any]]] = {}
        # (user agent, RBAC verb, group, resource[/subresource]) of every resource request
        self.calls: list[tuple[str, str, str, str]] = []
        self.namespaces: list[str | None] = []  # the namespace of each of those (None: all)
        self.watches: list[tuple[str, str | None]] = []  # (plural, labelSelector) opened
        self.tokens: set[str] | None = None  # bearer tokens accepted; None: no authentication
        self.token_log: list[tuple[str, str]] = []  # (user agent, token) of each request
        # Set (and replaced) on every change. A watcher takes the current event before
        # it reads the log, so a change after the read still wakes it. (An
        # asyncio.Condition waited on under wait_for can lose its lock when the
        # handler is cancelled on Python 3.11, which wedged every later write.)
        self._changed = asyncio.Event()
        for kind in BUILTIN_KINDS:
            self.register(kind)

    # -- configuration -------------------------------------------------------------
    def register(self, kind: Kind, short_names: tuple[str, ...] = (),
                 printer_columns: list[dict[str, Any]] | None = None) -> None:
        key = f"{kind.group}/{kind.version}/{kind.plural}" if kind.group else \
            f"{kind.version}/{kind.plural}"
        self.resources[key] = kmock.ResourceInfo(
            kind=kind.kind, namespaced=kind.namespaced, singular=kind.kind.lower(),
            verbs=VERBS, shortnames=set(short_names), subresources=set(kind.subresources))
        self.store.kinds[f"{kind.group}/{kind.plural}"] = kind
        if printer_columns:
            self.printer_columns[kind.plural] = printer_columns

    def register_crd(self, crd: dict[str, Any], validator: Any = None) -> Kind:
        spec, version = crd["spec"], crd["spec"]["versions"][0]
        scale = version.get("subresources", {}).get("scale")
        kind = Kind(spec["group"], version["name"], spec["names"]["plural"],
                    spec["names"]["kind"], spec["scope"] == "Namespaced",
                    tuple(version.get("subresources", {})),
                    (scale["specReplicasPath"], scale["statusReplicasPath"],
                     scale.get("labelSelectorPath", "")) if scale else None)
        self.register(kind, tuple(spec["names"].get("shortNames", ())),
                      version.get("additionalPrinterColumns"))
        if validator is not None:
            self.store.validators[kind.plural] = validator
        return kind

    def fail_next(self, method: str, plural: str, status: int = 409, count: int = 1,
                  message: str | None = None, reason: str = "Injected") -> None:
        """The next `count` `method` requests on `plural` fail with `status` (and `reason`
        and `message`, e.g. what the real API server would say)."""
        self.faults.append(Fault(method.upper(), plural, status, count, message, reason))

    async def _serve_version(self, request: kmock.Request) -> Any:
        """kmock's discovery, minus short names on subresources (as a real API server)."""
        body = await super()._serve_version(request)
        for resource in body.get("resources", ()):
            if "/" in resource["name"]:
                resource["shortNames"], resource["categories"] = [], []
        return body

    # -- direct access for tests (like kubectl, and the controllers we lack) ------------
    NotFound = ApiError  # what `store.get` raises for a missing object

    def kind(self, plural: str, group: str | None = None) -> Kind:
        for kind in self.store.kinds.values():
            if kind.plural == plural and (group is None or kind.group == group):
                return kind
        raise KeyError(plural)

    async def mutate(self, fn: Any) -> Any:
        """Run `fn(store)` and wake watchers; for controller simulations in tests."""
        result = fn(self.store)
        self._notify()
        return result

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- HTTP ----------------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.token_log.append((request.headers.get("User-Agent", ""), token))
        if self.tokens is not None and token not in self.tokens:
            raise kmock.KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")
        res = request.resource
        if res is None or not res.plural or res.version is None:
            return await kmock.KubernetesScaffold._handle(self, request)  # discovery
        kind = self.store.kinds.get(f"{res.group}/{res.plural}")
        if kind is None:
            raise kmock.KubernetesResourceNotFoundError()
        method = request.method.value.upper()
        self.calls.append((request.headers.get("User-Agent", ""), _verb(request, method),
                           kind.group, kind.plural + (f"/{request.subresource}"
                                                      if request.subresource else "")))
        self.namespaces.append(request.namespace)
        for fault in self.faults:
            if fault.count > 0 and fault.method == method and fault.plural == kind.plural:
                fault.count -= 1
                raise kmock.KubernetesError(
                    status=fault.status, reason=fault.reason,
                    message=fault.message or f"injected {fault.status} for {method}")
        try:
            return await self._dispatch(request, kind, method)
        except ApiError as e:
            raise kmock.KubernetesError(status=e.status, reason=e.reason, message=e.message,
                                        details=e.details or {"name": request.name,
                                                              "group": kind.group,
                                                              "kind": kind.plural})

    async def _dispatch(self, request: kmock.Request, kind: Kind,
                        method: str) -> aiohttp.web.StreamResponse:
        ns, name, sub = request.namespace, request.name, request.subresource
        params = request.params
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, kind)
        if method == "GET" and name is None:
            items = self.store.list(kind, ns, params.get("labelSelector"))
            items = _field_filter(items, params.get("fieldSelector"))
            if "as=Table" in request.headers.get("Accept", ""):
                return _json(self._table(kind, items))
            return _json({"apiVersion": kind.api_version, "kind": f"{kind.kind}List",
                          "metadata": {"resourceVersion": str(self.store.rv)}, "items": items})
        if method == "GET":
            obj = self.store.get(kind, ns, name)
            if sub == "scale":
                return _json(self.store.scale(kind, obj))
            if "as=Table" in request.headers.get("Accept", ""):
                return _json(self._table(kind, [obj]))
            return _json(obj)
        if method == "POST":
            result = self.store.create(kind, ns, request.data)
            if kind.plural == "customresourcedefinitions":  # serve the new resource
                self.register_crd(result, validator=_crd_validator(result))
        elif method == "PUT":
            body = request.data
            rv = (body.get("metadata") or {}).get("resourceVersion")
            result = self.store.write(kind, ns, name, sub, body, rv)
            if sub == "scale":
                result = self.store.scale(kind, result)
        elif method == "PATCH":
            ctype = request.headers.get("Content-Type", "application/merge-patch+json")
            result = self.store.patch(kind, ns, name, sub, request.data, ctype)
            if sub == "scale":
                result = self.store.scale(kind, result)
        elif method == "DELETE":
            result = self.store.delete(kind, ns, name)
        else:
            raise ApiError(405, "MethodNotAllowed", method)
        self._notify()
        return _json(result, status=201 if method == "POST" else 200)

    async def _watch(self, request: kmock.Request, kind: Kind) -> aiohttp.web.StreamResponse:
        params = request.params
        selector = params.get("labelSelector")
        self.watches.append((kind.plural, selector))
        timeout = float(params.get("timeoutSeconds") or 0) or None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        since = params.get("resourceVersion")
        if since and since.isdigit() and since != "0":
            position = next((i for i, e in enumerate(self.store.log) if e.rv > int(since)),
                            len(self.store.log))
        else:
            for obj in _field_filter(self.store.list(kind, request.namespace, selector),
                                     params.get("fieldSelector")):
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            position = len(self.store.log)
            if params.get("sendInitialEvents") == "true":  # WatchList (kubectl wait, informers)
                bookmark = {"type": "BOOKMARK", "object": {
                    "apiVersion": kind.api_version, "kind": kind.kind, "metadata": {
                        "resourceVersion": str(self.store.rv),
                        "annotations": {"k8s.io/initial-events-end": "true"}}}}
                await response.write(json.dumps(bookmark).encode() + b"\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        try:
            transport = request._raw_request.transport
            while deadline is None or loop.time() < deadline:
                if transport is None or transport.is_closing():
                    return response  # the client went away: end the watch now
                while position < len(self.store.log):
                    event = self.store.log[position]
                    position += 1
                    meta = event.obj["metadata"]
                    if (event.kind == kind
                            and (request.namespace is None or meta.get("namespace") == request.namespace)
                            and selector_matches(selector, meta.get("labels") or {})
                            and _field_filter([event.obj], params.get("fieldSelector"))):
                        line = {"type": event.type, "object": event.obj}
                        await response.write(json.dumps(line).encode() + b"\n")
                changed = self._changed
                if position < len(self.store.log):
                    continue
                try:
                    await asyncio.wait_for(changed.wait(), timeout=0.1)
                except TimeoutError:
                    pass
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response

    def _table(self, kind: Kind, items: list[dict[str, Any]]) -> dict[str, Any]:
        from k8s_table import render_table
        return render_table(self.printer_columns.get(kind.plural), items)


def _verb(request: kmock.Request, method: str) -> str:
    """The RBAC verb the API server would authorise this request as."""
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE" and not request.name:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]


def _crd_validator(crd: dict[str, Any]) -> Any:
    import k8s_schema

    schema = k8s_schema.crd_schema(crd)
    return lambda obj: k8s_schema.validate(schema, obj)


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


def _field_filter(items: list[dict[str, Any]], selector: str | None) -> list[dict[str, Any]]:
    """Only `metadata.name=` and `metadata.namespace=` field selectors (what clients use)."""
    if not selector:
        return items
    wanted = dict(part.split("=", 1) for part in selector.replace("==", "=").split(","))
    return [o for o in items if all(o["metadata"].get(k.split(".", 1)[1]) == v
                                    for k, v in wanted.items())]
