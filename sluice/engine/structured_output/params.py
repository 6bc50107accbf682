"""What a request's output must match (vLLM's `StructuredOutputsParams`): a declaration only.

Compiling it into a grammar is `manager.py`'s job; following it token by token is
`grammar.py`'s. The declaration is frozen and hashable: `key` names the compiled
grammar it needs, so equal constraints share one compilation.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

# The options that select what to match; exactly one is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json        a JSON schema, as canonical JSON text (`from_schema` makes it);
    regex       a regular expression the whole output matches;
    choice      the output is exactly one of these strings;
    grammar     an EBNF grammar in xgrammar's (GBNF-like) syntax, whose root rule is `root`;
    json_object any JSON object (OpenAI's `response_format: json_object`).

    `disable_any_whitespace`: JSON output has no whitespace beyond the one space
    after `:` and `,` (vLLM's option; by default any whitespace is allowed).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError("structured outputs take exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(chosen) or 'none'}")
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("structured outputs: choice needs at least one non-empty string")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"structured outputs: {name} must not be empty")

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str, **options: Any) -> StructuredOutputsParams:
        """A JSON-schema constraint; the schema's key order is kept (it orders the output)."""
        text = schema if isinstance(schema, str) else _json.dumps(
            schema, ensure_ascii=False, separators=(",", ":"))
        return cls(json=text, **options)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, specification, disable_any_whitespace): equal keys, one compiled grammar."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "choice":
            spec = _json.dumps(spec, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        return kind, spec, self.disable_any_whitespace

    def choice_grammar(self) -> str:
        """`choice` as an EBNF grammar: each string a JSON-escaped literal (xgrammar's
        string literals take the same escapes), so quotes, backslashes and newlines hold."""
        assert self.choice is not None
        return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice)
