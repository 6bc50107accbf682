"""Token ids of a request's prompt, exactly as the engine computes them.

Chat: the model's chat template rendered and encoded without special tokens
(what `Tokenizer.encode_chat`, shared with the engine, does), long segments such
as a shared system prompt taken from a `SegmentEncoder` cache; completions:
`encode(prompt)` with special tokens, or the token ids given. No tokenizer for
a model: None (routing then has no prefix information for it)."""

from __future__ import annotations

from typing import Any

from sluice.chat_template import template_messages
from sluice.gateway.prompt.segment_cache import SegmentEncoder
from sluice.tokenizer import Tokenizer


def is_token_id(t: object) -> bool:
    """An integer that fits the uint32 the request keys hash (bools are not ids)."""
    return type(t) is int and 0 <= t < 2**32


class PromptTokenizer:
    def __init__(self, by_model: dict[str, Tokenizer], default: Tokenizer | None = None) -> None:
        self.by_model = dict(by_model)
        self.default = default
        self._encoders = {id(t): SegmentEncoder(t) for t in [*self.by_model.values(), default]
                          if t is not None}

    @classmethod
    def from_paths(cls, specs: list[str]) -> PromptTokenizer:
        """Each spec is `PATH` (any model) or `MODEL=PATH`."""
        by_model, default = {}, None
        for spec in specs:
            name, sep, path = spec.partition("=")
            if sep:
                by_model[name] = Tokenizer.from_path(path)
            else:
                default = Tokenizer.from_path(spec)
        return cls(by_model, default)

    def token_ids(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        tok = self.by_model.get(body.get("model", ""), self.default)
        if kind == "chat":
            if tok is None:
                return None
            kwargs = dict(body.get("chat_template_kwargs") or {})
            text = tok.apply_chat_template(
                template_messages(body["messages"]),
                add_generation_prompt=body.get("add_generation_prompt", True),
                tools=body.get("tools"), **kwargs)
            return self._encoders[id(tok)].encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route on its first prompt
        if isinstance(prompt, list) and all(is_token_id(t) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and tok is not None:
            return tok.encode(prompt)
        return None
