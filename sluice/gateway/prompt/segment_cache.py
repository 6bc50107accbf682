"""Exact tokenization that reuses the ids of long segments seen before.

Routing tokenizes every prompt, and a long system prompt shared by many
requests costs about a microsecond per token each time (8 ms for 8k tokens).
HF `tokenizers` cuts a text at its added tokens (`<|im_start|>`, ...) first and
then normalizes, pre-tokenizes and encodes each piece between them on its own,
so for a text without post-processing

    encode(text) == encode(a) + encode(b) + ...

for any cut of `text` at added-token boundaries. `SegmentEncoder` cuts a
rendered chat at the added tokens around every segment of at least
`min_chars` characters, takes such segments' ids from an LRU cache keyed by
their text (or encodes and caches them), and encodes the short rest in one
call per stretch. The result equals `encode(text, add_special_tokens=False)`
token for token.

That identity needs added tokens that are matched as plain text: no
`lstrip` / `rstrip` / `single_word`, and not matched on normalized text. A
tokenizer with any other kind of added token gets no cache (`enabled` is
False): every call is a plain encode.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict

from sluice.tokenizer import Tokenizer


class SegmentEncoder:
    def __init__(self, tokenizer: Tokenizer, min_chars: int = 256,
                 max_cached_tokens: int = 2_000_000) -> None:
        """The cache holds at most `max_cached_tokens` ids (4 bytes each)."""
        assert min_chars > 0 and max_cached_tokens > 0
        self.tokenizer = tokenizer
        self.min_chars = min_chars
        self.max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        self.hits = 0
        self.misses = 0
        added = list(tokenizer.backend.get_added_tokens_decoder().values())
        plain = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        # Longest first: at one position the longest added token wins, as in tokenizers.
        contents = sorted({t.content for t in added}, key=len, reverse=True)
        self._added = re.compile("|".join(re.escape(c) for c in contents)) if added else None
        self.enabled = plain and bool(added) and self._cuts_are_exact(contents)

    def _cuts_are_exact(self, contents: list[str]) -> bool:
        """Probe: a text with added tokens encodes the same whole and cut (catches
        pre-tokenizers that treat the text's first piece differently)."""
        a, b = contents[-1], contents[0]
        pieces = ["Hello  world,", a, "again 12\n", b, "next\tword ", a, " x"]
        cut = [i for p in pieces for i in self.tokenizer.encode(p, add_special_tokens=False)]
        return cut == self.tokenizer.encode("".join(pieces), add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, reusing cached segments."""
        if not self.enabled or len(text) < self.min_chars:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        done = 0  # text[:done] is in ids; `done` is always at an added-token boundary
        for start, end in self._segments(text):
            if end - start < self.min_chars:
                continue
            if done < start:
                ids += self.tokenizer.encode(text[done:start], add_special_tokens=False)
            ids += self._cached(text[start:end])
            done = end
        if done < len(text):
            ids += self.tokenizer.encode(text[done:], add_special_tokens=False)
        return ids

    def _segments(self, text: str):
        """(start, end) of each stretch between added tokens, first and last included."""
        assert self._added is not None
        start = 0
        for m in self._added.finditer(text):
            yield start, m.start()
            start = m.end()
        yield start, len(text)

    def _cached(self, segment: str) -> array:
        hit = self._cache.get(segment)
        if hit is not None:
            self._cache.move_to_end(segment)
            self.hits += 1
            return hit
        self.misses += 1
        seg_ids = array("i", self.tokenizer.encode(segment, add_special_tokens=False))
        self._cache[segment] = seg_ids
        self._cached_tokens += len(seg_ids)
        while self._cached_tokens > self.max_cached_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)
        return seg_ids
