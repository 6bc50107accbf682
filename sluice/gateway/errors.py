"""OpenAI-shaped error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from sluice.gateway.http_wire import Response

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          431: "invalid_request_error",
          429: "rate_limit_error", 502: "api_error", 503: "service_unavailable",
          504: "timeout"}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None, headers: dict | None = None) -> Response:
    return Response(status, json.dumps(error_body(status, message, code, param)).encode(),
                    {"content-type": "application/json", **(headers or {})})


def sse_error(status: int, message: str, code: str | None = None) -> bytes:
    """An error as one SSE event, for failures after the stream has started."""
    return b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\n"
