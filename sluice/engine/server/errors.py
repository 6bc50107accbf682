"""OpenAI-shaped error responses."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


def error_response(message: str, status: int, param: str | None = None,
                   retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)
