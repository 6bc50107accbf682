"""Torch-free tokenizer, chat template and incremental detokenizer.

The engine and the gateway both import this module, so a chat request renders
and encodes to the *same* token ids in both (the gateway hashes prefixes of
them for KV-aware routing). Contracts:

* `Tokenizer.from_path` reads an HF model folder (tokenizer.json,
  tokenizer_config.json, optional chat_template.jinja / generation_config.json)
  or a .gguf file whose vocabulary is byte-level BPE (`tokenizer.ggml.model`
  == "gpt2"). Nothing is downloaded.
* `apply_chat_template` renders like transformers (sandboxed jinja2,
  trim_blocks, lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping
  `tojson`, special tokens as variables); `encode_chat` encodes the rendered
  text with `add_special_tokens=False`, as vLLM does.
* `IncrementalDetokenizer` streams text deltas whose concatenation (plus
  `finish()`) equals `decode(output_ids)`; it never emits the U+FFFD of a
  character whose bytes are still incomplete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from sluice.byte_level_fast import FastByteLevelEncoder
from sluice.chat_template import REASONING_FIELDS, compile_template, plain
from sluice.gguf_tokenizer import gguf_byte_level_tokenizer

_INCREMENTAL_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, Mapping) else value


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _folder_chat_template(folder: str, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over chat_template.json and tokenizer_config.json
    (transformers' precedence); a list of named templates yields "default"."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    template = template if template is not None else config.get("chat_template")
    if isinstance(template, list):
        named = {item["name"]: item["template"] for item in template}
        template = named.get("default")
    return template


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template around it."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """`special_tokens` ({"bos_token": text, ...}) are chat-template variables."""
        self._tok = backend
        self._fast = FastByteLevelEncoder.build(backend)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(
            {*extra_eos_token_ids, *([eos_token_id] if eos_token_id is not None else [])}
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._special_vars = dict(special_tokens or {})

    @classmethod
    def from_path(cls, path: str) -> Tokenizer:
        """Load from an HF model folder or a GGUF file (offline)."""
        if os.path.isfile(path):
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ValueError(f"{path!r} is a file but not a GGUF file")
            import gguf

            backend, meta = gguf_byte_level_tokenizer(gguf.GGUFReader(path))
            return cls(
                backend,
                bos_token_id=meta["bos_token_id"],
                eos_token_id=meta["eos_token_id"],
                extra_eos_token_ids=meta["eos_ids"],
                chat_template=meta["chat_template"],
                special_tokens=meta["special_tokens"],
            )
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise FileNotFoundError(
                f"{path!r} is neither a .gguf file nor a folder with tokenizer.json"
            )
        backend = _HFTokenizer.from_file(tokenizer_json)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation = _read_json(os.path.join(path, "generation_config.json"))
        names = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        special = {name: text for name, text in names.items() if text is not None}
        bos, eos = (
            backend.token_to_id(special[n]) if n in special else None
            for n in ("bos_token", "eos_token")
        )
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=_as_id_set(generation.get("eos_token_id")),
            chat_template=_folder_chat_template(path, config),
            special_tokens=special,
        )

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (do not mutate it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        ASCII text takes the exact fast path when the tokenizer has one (the
        post-processors it allows add no ids, so `add_special_tokens` is moot)."""
        if self._fast is not None and text.isascii():
            return self._fast.encode(text)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD); no space clean-up."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of `ids` ("" for an id outside the vocabulary)."""
        return [self._tok.id_to_token(int(i)) or "" for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template, exactly as transformers'
        `apply_chat_template(tokenize=False)`. Extra kwargs become template
        variables (and override bos_token/eos_token/... if given)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions API instead")
        chat = plain(list(messages))
        for i, message in enumerate(chat):
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            reasoning = next(
                (message[k] for k in REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                chat[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        documents = plain(kwargs.pop("documents", None))
        variables = {**self._special_vars, **plain(kwargs)}
        return compile_template(self.chat_template).render(
            messages=chat,
            tools=plain(tools),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """`encode(apply_chat_template(...), add_special_tokens=False)`."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """vLLM-style streaming detokenization over a sliding window of ids.

    Each step decodes ids[prefix_offset:read_offset] and ids[prefix_offset:];
    the difference is the new text. Text ending in U+FFFD (an incomplete
    character) is held back until the next token completes it; `finish()`
    returns whatever is still held back at the end of the stream.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids)
        self._prompt_len = len(self._ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _INCREMENTAL_CONTEXT_TOKENS, 0)
        context = tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens)
        if context.endswith(_REPLACEMENT_CHAR):  # prompt ends mid-character: start clean
            self._prefix_offset = self._read_offset
        self.output_text = ""  # concatenation of every delta returned so far

    @property
    def output_token_ids(self) -> list[int]:
        """The ids added after the prompt."""
        return self._ids[self._prompt_len :]

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset :], self._skip)
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and not final
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += delta
        return delta

    def add_token(self, token_id: int) -> str:
        """Append one generated id; return the text it completes (maybe "")."""
        self._ids.append(int(token_id))
        return self._delta(final=False)

    def finish(self) -> str:
        """End of stream: the held-back tail (U+FFFD for bytes never completed)."""
        return self._delta(final=True) if self._read_offset < len(self._ids) else ""
