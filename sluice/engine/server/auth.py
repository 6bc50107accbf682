"""The engine's own key (`--api-key`, or `$VLLM_API_KEY`, as vLLM), a pure ASGI middleware.

With a key, every request but `GET /health` and `GET /metrics` (probes and
scrapes) must carry `Authorization: Bearer <key>`, else 401 (OpenAI-shaped).
The admin surface (`/reset_prefix_cache`, the LoRA load/unload endpoints, `/docs`,
`/redoc`, `/openapi.json`) is served only to holders of the key: without a key
configured it is not served at all (404), so an engine reachable by anyone exposes
no more than vLLM's API.
Keys are compared by SHA-256 digest (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import MutableMapping
from typing import Any

from sluice.engine.server.body_limit import ASGIApp, Receive, Send
from sluice.openai_error import error_json

OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/docs", "/docs/oauth2-redirect", "/redoc",
                         "/openapi.json", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._digest is None:
            if path in ADMIN_PATHS:
                await _answer(send, 404, "not served: start the engine with --api-key to "
                                         "reach its admin endpoints and API docs")
                return
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await _answer(send, 401, "Incorrect or missing API key: send Authorization: "
                                     "Bearer <key>", [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: MutableMapping[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = hashlib.sha256(value[7:].strip()).digest()
                return hmac.compare_digest(presented, self._digest or b"")
        return False


async def _answer(send: Send, status: int, message: str,
                  headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_json(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})
