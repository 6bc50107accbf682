"""A pure ASGI middleware that caps HTTP request bodies (413, OpenAI-shaped).

Contract, for every HTTP request:
- a Content-Length above `max_bytes` is answered 413 at once: the app is never
  called and the body is never read (uvicorn discards it after the answer);
- a body without a usable Content-Length (chunked) is counted as it streams; the
  moment the count passes `max_bytes` the middleware answers 413 itself, and from
  then on the app only sees `http.disconnect` from `receive` (so it stops reading,
  as for a client that went away) and whatever it sends is dropped;
- anything under the limit passes through untouched.

It sits in front of every body parser, so no request body over the limit is
ever buffered whole in memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sluice.openai_error import error_json

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await _send_too_large(send, self.max_bytes, length)
            return
        await _LimitedRequest(self.max_bytes, receive, send).run(self.app, scope)


class _LimitedRequest:
    """One request's byte count and whether the middleware has answered it."""

    def __init__(self, max_bytes: int, receive: Receive, send: Send):
        self.max_bytes = max_bytes
        self._receive = receive
        self._send = send
        self.received = 0
        self.response_started = False
        self.cut = False  # the body passed the limit: the app reads no more of it
        self.answered = False  # the middleware sent the 413

    async def run(self, app: ASGIApp, scope: MutableMapping[str, Any]) -> None:
        await app(scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.cut:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received <= self.max_bytes:
            return message
        self.cut = True
        if not self.response_started:  # else the app answered already; just stop its reading
            await _send_too_large(self._send, self.max_bytes, None)
            self.answered = True
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.answered:
            return  # the 413 is the answer; the app's own (to a "disconnect") is moot
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)


def _content_length(scope: MutableMapping[str, Any]) -> int | None:
    """The declared body size; None when absent or malformed (then the stream is counted)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_too_large(send: Send, max_bytes: int, length: int | None) -> None:
    size = f"{length} bytes" if length is not None else "more than that"
    body = error_json(413, f"the request body is too large: the limit is {max_bytes} bytes "
                           f"(--max-request-body-bytes), this one is {size}")
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
