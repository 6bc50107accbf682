"""The gateway's error answers, in the one shape of `sluice.openai_error`."""

from __future__ import annotations

from sluice.gateway.http_wire import Response
from sluice.openai_error import error_json


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> Response:
    return Response(status, error_json(status, message, param),
                    {"content-type": "application/json", **(headers or {})})


def sse_error(status: int, message: str) -> bytes:
    """An error as one SSE event, for failures after the stream has started."""
    return b"data: " + error_json(status, message) + b"\n\n"
