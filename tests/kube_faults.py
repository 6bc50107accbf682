"""A fault-injecting reverse proxy in front of the tests' real kube-apiserver, for the
failures a real server cannot be made to give on demand: a 503 while etcd changes leader,
a 429 from priority and fairness, a 409 on a write. Everything else is forwarded to the
real server as is (watch streams chunk by chunk), so what the client gets is the real
server's answer except for the requests it was told to fail.

Refusals a real server does give (422 invalid, 403 quota or admission, a name taken)
come from the real server, not from here.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import ssl
from dataclasses import dataclass
from typing import Self

import aiohttp
from aiohttp import web
from kube_api import ControlPlane

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones aiohttp sets itself: not forwarded.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_REASONS = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError",
            503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Fault:
    method: str
    resource: str  # plural, e.g. "deployments"
    status: int
    count: int  # left to give
    message: str
    reason: str


def resource_of(path: str) -> str:
    """The resource plural a request path names: /api/v1/namespaces/ns/pods/x -> pods,
    /apis/apps/v1/deployments -> deployments, /api/v1/namespaces/ns -> namespaces."""
    parts = [p for p in path.split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        return rest[2]
    return rest[0] if rest else ""


class FaultProxy:
    """`async with FaultProxy(plane) as proxy`: listens on 127.0.0.1 (plain HTTP, loopback
    only) and forwards to `plane` over TLS, the client's Authorization header included.
    `fail_next` answers the next matching requests with an error instead."""

    def __init__(self, plane: ControlPlane):
        self.plane = plane
        self.faults: list[Fault] = []
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def fail_next(self, method: str, resource: str, status: int, count: int = 1,
                  message: str = "", reason: str | None = None) -> Fault:
        """The next `count` `method` requests on `resource` (a plural) get `status` with
        a Kubernetes Status body carrying `message`, without reaching the server."""
        fault = Fault(method.upper(), resource, status, count, message,
                      reason or _REASONS.get(status, ""))
        self.faults.append(fault)
        return fault

    def kubeconfig(self, name: str = "via-fault-proxy") -> pathlib.Path:
        """A kubeconfig for the admin, through this proxy."""
        path = self.plane.root / "kubeconfigs" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": name, "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": name, "user": {"token": self.plane.admin_token}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    async def __aenter__(self) -> Self:
        tls = ssl.create_default_context(cafile=str(self.plane.ca_file))
        # Bodies pass through as the server encoded them (gzip included).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # The upstream session first: open watches end, so their handlers return.
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _take(self, method: str, resource: str) -> Fault | None:
        for fault in self.faults:
            if fault.count > 0 and fault.method == method and fault.resource == resource:
                fault.count -= 1
                return fault
        return None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        fault = self._take(request.method, resource_of(request.path))
        if fault is not None:
            return web.json_response(status=fault.status, data={
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": fault.message, "reason": fault.reason, "code": fault.status})
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        async with self._session.request(
                request.method, self.plane.url + request.rel_url.raw_path_qs,
                headers=headers, data=body or None, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP:
                    response.headers.add(key, value)
            await response.prepare(request)
            # A watch is one long response: each event goes on as it comes. It ends when
            # the server ends it, the client goes, or the proxy closes.
            with contextlib.suppress(aiohttp.ClientError, ConnectionResetError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            return response
