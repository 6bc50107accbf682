"""A faster, exact encoder for byte-level BPE tokenizers on ASCII text.

Why: HF `tokenizers` spends ~1 us per token on the CI machine, most of it in
its pre-tokenizer's Oniguruma regex (a 200-token prompt: ~260 us), which made
tokenization the largest part of a kv_aware routing decision.

How: HF encodes `added-token split -> pre-tokenize -> BPE of each piece`, and
BPE sees one piece at a time. For ASCII text this module does the split and
the pre-tokenization with one Python `re` pattern equivalent to the GPT-2
pattern (and the `Digits(individual_digits=True)` split before it, if
configured), and caches the ids of each piece; a piece seen for the first time
goes through the tokenizer's own BPE model (`model.tokenize` of its byte-level
form), so merges are never reimplemented.

Exactness: built only for configurations it reproduces: no normalizer;
pre-tokenizer ByteLevel(add_prefix_space=False, use_regex=True), alone or after
Digits(individual_digits=True); a BPE model without dropout, byte fallback or
word affixes; no post-processor that adds ids; no truncation or padding; only
special added tokens in ASCII (HF matches non-special ones in a second pass),
none with lstrip / rstrip / single_word; `encode_special_tokens` off.
`FastByteLevelEncoder.build` returns None for anything else, and callers send
non-ASCII text to HF. Tests compare it with HF on fuzzed text.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

from sluice.gguf_tokenizer import bytes_to_unicode

_WS = r"\t\n\x0b\x0c\r "  # Unicode White_Space within ASCII (not \x1c-\x1f, unlike re's \s)


def _pieces_pattern(individual_digits: bool) -> str:
    """GPT-2's `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`
    for ASCII. With digits split off first, each digit is a piece of its own, a space
    before it ends the previous segment, and a digit ends a run of spaces as the end
    of text does."""
    digits, end_of_ws = ((r"[0-9]", rf"[^{_WS}0-9]") if individual_digits
                         else (r" ?[0-9]+", rf"[^{_WS}]"))
    return (rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+|{digits}| ?[^{_WS}A-Za-z0-9]+"
            rf"|[{_WS}]+(?!{end_of_ws})|[{_WS}]+")


def _eligible_pre_tokenizer(pre: Any) -> bool | None:
    """individual_digits flag of a supported pre-tokenizer, or None."""
    def byte_level(p: Any) -> bool:
        return (p.get("type") == "ByteLevel" and not p.get("add_prefix_space")
                and p.get("use_regex", True))
    if pre is None:
        return None
    if byte_level(pre):
        return False
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        digits, last = pre["pretokenizers"]
        if digits.get("type") == "Digits" and digits.get("individual_digits") and \
                byte_level(last):
            return True
    return None


class FastByteLevelEncoder:
    MAX_CACHED_PIECES = 100_000
    MAX_CACHED_PIECE_CHARS = 64  # longer pieces are rare; caching them would let
                                 # request text grow the cache without bound

    def __init__(self, model: Any, individual_digits: bool,
                 added: dict[str, int]) -> None:
        self._model = model
        self._pieces = re.compile(_pieces_pattern(individual_digits))
        self._added = added
        self._split = (re.compile("(" + "|".join(
            re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added else None)
        self._added_firsts = sorted({t[0] for t in added})  # none in a text: no split
        self._to_byte_level = str.maketrans(  # ASCII text: the first 128 bytes
            {b: ch for b, ch in bytes_to_unicode().items() if b < 128})
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def build(cls, backend: Any) -> FastByteLevelEncoder | None:
        """An encoder equal to `backend.encode(text).ids` on ASCII text, or None when
        the tokenizer's configuration is not one it reproduces."""
        cfg = json.loads(backend.to_str())
        model = cfg.get("model") or {}
        digits = _eligible_pre_tokenizer(cfg.get("pre_tokenizer"))
        post = cfg.get("post_processor")
        if (cfg.get("normalizer") is not None or digits is None
                or model.get("type") != "BPE" or model.get("dropout") is not None
                or model.get("byte_fallback") or model.get("continuing_subword_prefix")
                or model.get("end_of_word_suffix")
                or (post is not None and post.get("type") != "ByteLevel")
                or cfg.get("truncation") is not None or cfg.get("padding") is not None
                or getattr(backend, "encode_special_tokens", False)):
            return None
        added = {}
        for tok in cfg.get("added_tokens", []):
            if not tok["content"].isascii():
                continue  # never found in ASCII text
            if not tok.get("special") or tok.get("lstrip") or tok.get("rstrip") or \
                    tok.get("single_word") or not tok["content"]:
                return None
            added[tok["content"]] = tok["id"]
        return cls(backend.model, digits, added)

    def encode(self, text: str) -> list[int]:
        """Token ids of ASCII `text` (special tokens written in it are matched whole)."""
        assert text.isascii()
        if self._split is None or not any(c in text for c in self._added_firsts):
            return self._encode_plain(text)
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self._added[part])
            elif part:
                ids += self._encode_plain(part)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        pieces = self._pieces.findall(text)
        cache = self._cache
        found = list(map(cache.get, pieces))  # (loops in C: most pieces are cached)
        if None in found:
            for i, got in enumerate(found):
                if got is None:
                    piece = pieces[i]
                    found[i] = got = [t.id for t in self._model.tokenize(
                        piece.translate(self._to_byte_level))]
                    if len(piece) <= self.MAX_CACHED_PIECE_CHARS:
                        if len(cache) >= self.MAX_CACHED_PIECES:
                            cache.clear()
                        cache[piece] = got
        return list(chain.from_iterable(found))
