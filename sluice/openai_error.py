"""The one error shape every Sluice component answers with (engine, gateway, picker).

vLLM's shape, which the OpenAI SDK reads as an APIError:
    {"error": {"message": str, "type": str, "param": str | null, "code": int}}
`type` names the HTTP status the way vLLM does (BadRequestError, NotFoundError, ...);
`code` is the HTTP status. A leaf module: no web framework, no torch.
"""

from __future__ import annotations

import json
from http import HTTPStatus

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
          413: "RequestTooLargeError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 431: "RequestHeaderFieldsTooLargeError",
          500: "InternalServerError", 502: "BadGatewayError",
          503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_type(status: int) -> str:
    return _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": status}}


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, param)).encode()
