"""Chat-template rendering exactly as transformers' `apply_chat_template(tokenize=False)`:
sandboxed jinja2 with trim_blocks / lstrip_blocks, `raise_exception`,
`strftime_now`, a non-escaping `tojson`, and template data rebuilt from plain
JSON types.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers
    uses it to track assistant tokens; rendering is unchanged)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def plain(value: Any) -> Any:
    """Template data rebuilt from plain JSON types (as transformers does), so
    the sandbox never sees a caller's rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, list):
        return [plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the template sees them (engine and gateway alike), as
    vLLM passes them: fields set to null are dropped, missing or null content is ""
    (an assistant message that only calls tools), list-of-parts content is joined into
    one text, and tool calls' `arguments` JSON text becomes the object templates
    expect. Raises ValueError on a non-text part or arguments that are not JSON."""
    out = []
    for m in messages:
        d = {k: v for k, v in m.items() if v is not None}
        d.setdefault("content", "")
        if isinstance(d.get("tool_calls"), list):
            d["tool_calls"] = [_template_tool_call(c) for c in d["tool_calls"]]
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"unsupported content part type {kind!r}")
                texts.append(part.get("text", ""))
            d["content"] = "".join(texts)
        out.append(d)
    return out


def _template_tool_call(call: Any) -> Any:
    """A copy of an assistant tool call whose function.arguments is an object ({} if empty)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise ValueError(f"tool call arguments are not valid JSON: {exc}") from exc
    return {**call, "function": {**function, "arguments": {} if args is None else args}}
