"""An OpenAI request body, checked before any routing work (nothing malformed goes on).

`parse_request(kind, body)` returns the JSON object or raises `BadRequest`
(400, with the parameter at fault): not JSON (NaN and Infinity included, which
Python's json module would accept), not an object, no `model`, no `messages` /
`prompt` of a valid form, `stream` not a boolean, or text holding a lone UTF-16
surrogate (no tokenizer takes it; the engines would refuse it too). The engine
judges every other field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sluice.gateway.prompt.tokenize import is_token_id

# Raw UTF-8 cannot encode a surrogate (json.loads refuses it), so only a body with
# a `\uD800`..`\uDFFF` escape can hold one: the walk below runs for those only.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def parse_request(kind: str, body: bytes) -> dict[str, Any]:
    """`kind`: "chat" or "completion"."""
    try:
        data = _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise BadRequest(f"request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object", "body")
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise BadRequest("'model' is required and must be a string", "model")
    if kind == "chat":
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of objects", "messages")
    elif not _is_prompt(data.get("prompt")):
        raise BadRequest("'prompt' is required: a string, a list of strings, a list of "
                         "token ids (0 to 2^32-1) or a list of such lists, not empty",
                         "prompt")
    if "stream" in data and not isinstance(data["stream"], bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    if _SURROGATE_ESCAPE.search(body) is not None and _holds_lone_surrogate(data):
        raise BadRequest("text holds a lone UTF-16 surrogate, which is not valid Unicode")
    return data


def _holds_lone_surrogate(data: Any) -> bool:
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def _is_prompt(p: Any) -> bool:
    """A string or a non-empty list of strings, token ids or lists of ids (the
    engine judges the element types); nothing nested deeper; integer ids must
    fit 0 .. 2^32-1."""
    if isinstance(p, str):
        return True
    if not isinstance(p, list) or not p:
        return False
    ids = [t for x in p for t in (x if isinstance(x, list) else [x])]
    if any(isinstance(t, (list, dict)) for t in ids):
        return False
    return all(is_token_id(t) for t in ids if isinstance(t, int) and not isinstance(t, bool))


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# json.loads(body, parse_constant=...) builds a decoder per call (~5 us); this is its one
# decoder, fed as json.loads feeds it (UTF-8, -16 or -32, detected).
_DECODER = json.JSONDecoder(parse_constant=_not_json)
