"""HTTP/1.1 message heads, shared by the gateway's server and its engine client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_date = [0, ""]  # [second, its IMF-fixdate]


@dataclass(frozen=True, slots=True)
class Response:
    """A whole answer. `headers`: lower-case names, without the framing ones
    (content-length, transfer-encoding, connection), which the server adds."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def http_date() -> str:
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, formatdate(now, usegmt=True)
    return _date[1]


def _check(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError(f"line break in an HTTP header: {value!r}")
    return value


def response_head(status: int, headers: dict[str, str], length: int | None,
                  keep_alive: bool, chunked: bool = True) -> bytes:
    """Status line and headers; `length` None: a streamed body (chunked, or ended
    by closing the connection when not `chunked`)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\ndate: {http_date()}\r\n"]
    lines.extend(f"{k}: {_check(v)}\r\n" for k, v in headers.items())
    if length is not None:
        lines.append(f"content-length: {length}\r\n")
    elif chunked:
        lines.append("transfer-encoding: chunked\r\n")
    if not keep_alive:
        lines.append("connection: close\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def request_head(method: str, target: str, host: str, headers: dict[str, str],
                 length: int) -> bytes:
    """Request line and headers for a body of `length` bytes (keep-alive)."""
    lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n"]
    lines.extend(f"{k}: {_check(v)}\r\n" for k, v in headers.items())
    if length or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
