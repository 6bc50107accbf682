"""Strict parsing of JSON request bodies, before FastAPI and pydantic see them.

Python's `json.loads` accepts more than JSON: NaN and Infinity literals,
numbers that overflow to inf, text that is not UTF-8 (it guesses UTF-16/32),
and strings holding lone UTF-16 surrogates ("\\ud800"), which are not Unicode
text: the tokenizer, the response encoder and the chat template all fail on
them. Deep nesting makes it raise RecursionError. `parse_json_body` refuses all
of these with a RequestError (400) naming the field, so nothing past it ever
holds such a value.

`StrictJSONRoute` installs the parser on a FastAPI route: FastAPI's body
handling then reads the already parsed, already checked value.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sluice.engine.server.errors import RequestError, request_error_response

# Deeper than any OpenAI body (a tool's JSON schema included) needs; it keeps every
# later recursive walk (pydantic, the chat template's tojson) far from Python's limit.
MAX_JSON_DEPTH = 64
OFF_LOOP_BYTES = 256 * 1024  # bodies above this are parsed on a worker thread


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of `raw`, or RequestError (400) when it is not strict, valid JSON.

    Refused: bytes that are not UTF-8; syntax errors; NaN, Infinity, -Infinity and
    numbers too large to be finite; integers too long for Python to parse; nesting
    deeper than MAX_JSON_DEPTH; any string or object key holding a lone surrogate.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not valid UTF-8 (byte {exc.start} "
                           f"is {raw[exc.start:exc.start + 1]!r})") from exc
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # NaN / inf, or an integer over Python's digit limit
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """RequestError naming the field if `value` nests too deep or holds a lone surrogate.

    Iterative (no recursion). The pass over every container, key and string keeps
    no paths (a body may hold millions of small lists); only when it finds a
    fault does a second pass build paths, to name the field.
    """
    if not _is_clean(value):
        _raise_fault(value)


def _is_clean(value: Any) -> bool:
    if isinstance(value, str):
        return _valid_text(value)
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if type(item) is dict:
            if not all(_valid_text(key) for key in item):
                return False
            children: Any = item.values()
        elif type(item) is list:
            children = item
        else:
            continue
        if depth >= MAX_JSON_DEPTH:
            return False
        for child in children:
            kind = type(child)
            if kind is str:
                if not _valid_text(child):
                    return False
            elif kind is dict or kind is list:
                stack.append((child, depth + 1))
    return True


def _raise_fault(value: Any) -> None:
    """The slow pass: find the fault `_is_clean` saw and raise it with the field's path."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _valid_text(item):
                raise _surrogate_error(item, path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if len(path) >= MAX_JSON_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                               _param(path))
        if isinstance(item, dict):
            for key, child in item.items():
                if not _valid_text(key):
                    raise _surrogate_error(key, path)
                stack.append((child, (*path, key)))
        else:
            stack.extend((child, (*path, i)) for i, child in enumerate(item))
    raise AssertionError("_is_clean and _raise_fault disagree")


def _valid_text(text: str) -> bool:
    """False for a lone surrogate: the only str json.loads makes that UTF-8 cannot encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_error(text: str, path: tuple[str | int, ...]) -> RequestError:
    at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    where = ".".join(str(p) for p in path) or "the request body"
    return RequestError(f"{where}: the text holds a lone UTF-16 surrogate "
                        f"(\\u{ord(text[at]):04x} at character {at}), which is not valid "
                        f"Unicode", _param(path))


def _param(path: tuple[str | int, ...]) -> str | None:
    """The top-level field: OpenAI's `param` (the message carries the full path)."""
    return str(path[0]) if path else None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:32]} is too large")
    return value


class _StrictJSONRequest(Request):
    """A Request whose json() is `parse_json_body` (FastAPI parses bodies through json()).

    A large body is parsed on a worker thread: a 16 MiB one takes a good part of a
    second, which would stall every other request's stream on the event loop.
    """

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            if len(raw) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_json_body, raw)
            else:
                self._json = parse_json_body(raw)
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute that parses a non-empty body strictly before FastAPI's own handling.

    A RequestError becomes its OpenAI-shaped answer. A body the client stopped
    sending (or that the body-size limit cut off, having answered 413 already)
    gets a bare 400 that nobody reads.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            strict = _StrictJSONRequest(request.scope, request.receive)
            try:
                if await strict.body():
                    await strict.json()
            except RequestError as exc:
                return request_error_response(exc)
            except ClientDisconnect:
                return Response(status_code=400)
            return await handler(strict)

        return strict_handler
