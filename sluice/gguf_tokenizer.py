"""GGUF vocabulary -> a `tokenizers` byte-level BPE tokenizer (llama.cpp conventions).

Part of the torch-free tokenizer (see sluice/tokenizer.py); reads metadata with
the `gguf` package only.
"""

from __future__ import annotations

from typing import Any

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


def bytes_to_unicode() -> dict[int, str]:
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


def gguf_byte_level_tokenizer(reader: Any) -> tuple[_HFTokenizer, dict[str, Any]]:
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
    spelling = bytes_to_unicode()
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
