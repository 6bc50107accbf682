"""The engine's error answers: every one in the OpenAI shape of `sluice.openai_error`.

Contract: whatever the engine answers with a 4xx or 5xx status, including the
answers FastAPI and Starlette would otherwise write themselves (unknown path
404, wrong method 405, body parse errors, validation errors, an unexpected
exception's 500), is `{"error": {"message", "type", "param", "code"}}` with
`code` equal to the HTTP status. Validation errors answer 400, as vLLM does,
not FastAPI's 422.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from sluice.openai_error import error_body

log = logging.getLogger("sluice.engine")


class RequestError(ValueError):
    """Client input the engine refuses: answered with `status` (default 400) naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 retry_after: int | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.retry_after = retry_after


def error_response(message: str, status: int, param: str | None = None,
                   retry_after: int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    # ensure_ascii (json.dumps' default): client text echoed in a message (a model
    # name, a field value) may hold lone surrogates, which UTF-8 cannot encode.
    return _AsciiJSONResponse(error_body(status, message, param), status_code=status,
                              headers=headers or None)


def request_error_response(exc: RequestError) -> JSONResponse:
    return error_response(str(exc), exc.status, exc.param, exc.retry_after)


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's and Starlette's own error answers with OpenAI-shaped ones."""
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(RequestError, _request_error)
    # Exception: Starlette's ServerErrorMiddleware answers with this handler and then
    # re-raises, so the traceback still reaches the server log.
    app.add_exception_handler(Exception, _unexpected)


async def _invalid_request(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":  # FastAPI's own JSON decode error
        return error_response(f"the request body is not valid JSON: "
                              f"{first.get('ctx', {}).get('error', message)}", 400)
    text = f"{'.'.join(loc)}: {message}" if loc else message
    # param is the top-level field, as OpenAI names it; the message has the full path.
    return error_response(text, 400, loc[0] if loc else None)


async def _http_exception(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    headers = dict(exc.headers or {})  # e.g. Allow on a 405
    return error_response(str(exc.detail), exc.status_code, headers=headers)


async def _request_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return request_error_response(exc)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error answering a request: %r", exc)
    return error_response("internal server error", 500)


class _AsciiJSONResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")
