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

import functools
import json
import os
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

# GGUF token types (llama.cpp `llama_token_type`).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer families, keyed by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# Every digit is its own pre-token, then the GPT-2 regex (llama.cpp's "\p{N}" +
# gpt2 split; the HF tokenizer.json of these models is Digits + ByteLevel).
_DIGITS_PRE = frozenset(("smollm", "starcoder", "refact", "codeshell"))

_INCREMENTAL_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
_REPLACEMENT_CHAR = "\ufffd"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """Value of GGUF metadata `key` from a `gguf.GGUFReader`: str, int, float,
    bool, or a list of those for arrays; `default` when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    import gguf

    def one(index: int, value_type: Any) -> Any:
        part = field.parts[index]
        if value_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(i, field.types[-1]) for i in field.data]
    return one(field.data[0], field.types[0])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    assert len(set(table.values())) == 256
    return table


def _gguf_byte_level_tokenizer(reader: Any) -> tuple[_HFTokenizer, dict[str, Any]]:
    """Build a byte-level BPE `tokenizers.Tokenizer` from GGUF metadata."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
        )
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] = gguf_field(reader, "tokenizer.ggml.merges") or []
    assert len(types) == len(tokens), "token_type and tokens differ in length"
    spelling = _bytes_to_unicode()
    alphabet = frozenset(spelling.values())

    def spell(token: str) -> str:  # tokens outside the byte alphabet are stored as plain text
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spell(token): index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    if pre in _SPLIT_REGEX_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:  # "gpt-2", "default" and the rest: GPT-2's own regex inside ByteLevel
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control tokens are special; user-defined ones are matched whole but not special.
    # One whose text is not in the byte alphabet is a llama.cpp mislabel; skip it.
    tok.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind_ in zip(tokens, types)
            if kind_ == _GGUF_CONTROL and set(t) <= alphabet
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, types)
            if kind_ == _GGUF_USER_DEFINED and set(t) <= alphabet
        ]
    )
    special = {
        name: gguf_field(reader, f"tokenizer.ggml.{name}_token_id")
        for name in ("bos", "eos", "eot", "eom", "unknown", "padding")
    }
    bos, eos = special["bos"], special["eos"]
    # llama.cpp adds BOS / EOS around the text when these flags say so.
    add_bos = bos is not None and bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = eos is not None and bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        single = " ".join(
            [f"{tokens[bos]}:0"] * add_bos + ["$A:0"] + [f"{tokens[eos]}:0"] * add_eos
        )
        ids = [(tokens[bos], bos)] * add_bos + [(tokens[eos], eos)] * add_eos
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    names = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": special["unknown"],
        "pad_token": special["padding"],
    }
    return tok, {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "eos_ids": {special[k] for k in ("eos", "eot", "eom") if special[k] is not None},
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
        "special_tokens": {name: tokens[i] for name, i in names.items() if i is not None},
    }


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
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Template data rebuilt from plain JSON types (as transformers does), so
    the sandbox never sees a caller's rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


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

            backend, meta = _gguf_byte_level_tokenizer(gguf.GGUFReader(path))
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
        """Token ids of `text`; special tokens written in the text are matched whole."""
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
        chat = _plain(list(messages))
        for i, message in enumerate(chat):
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
            reasoning = next(
                (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
            )
            if reasoning is not None:
                chat[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        documents = _plain(kwargs.pop("documents", None))
        variables = {**self._special_vars, **_plain(kwargs)}
        return _compile_template(self.chat_template).render(
            messages=chat,
            tools=_plain(tools),
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
