"""The fast byte-level BPE path against HF `tokenizers` (which it must equal exactly)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from sluice.byte_level_fast import FastByteLevelEncoder
from sluice.default_model import resolve_default_model
from sluice.tokenizer import Tokenizer

# fragments that exercise every branch of the GPT-2 split, the digit split and
# the added-token split: contractions (and near misses), whitespace runs before
# letters / digits / punctuation / the end, control bytes, special tokens
ALPHABET = [*"abzAZ0159 \t\n\r\x0b\x0c\x1c\x1f\x00\x7f'!?.,-_<>|\"#$%&()*+/:;=@[\\]^`{}~",
            "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", " '", "  ", "\n\n", "\r\n",
            " \t", "123", " 45", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start",
            "<|im_start|", "im_end|>", "<repo_name>", "<reponame>", "hello", " world"]


@pytest.fixture(scope="module")
def default_backend() -> HFTokenizer:
    return Tokenizer.from_path(resolve_default_model()).backend


def _variant(backend: HFTokenizer, **changes) -> HFTokenizer:
    cfg = json.loads(backend.to_str())
    cfg.update(changes)
    return HFTokenizer.from_str(json.dumps(cfg))


def _fuzz(backend: HFTokenizer, n: int, seed: int) -> None:
    fast = FastByteLevelEncoder.build(backend)
    assert fast is not None
    rng = random.Random(seed)
    for _ in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 30)))
        assert fast.encode(text) == backend.encode(text).ids, repr(text)


def test_default_model_digits_then_byte_level_matches_hf(default_backend):
    _fuzz(default_backend, 6000, seed=0)


def test_plain_byte_level_matches_hf(default_backend):
    plain = _variant(default_backend, pre_tokenizer={
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
        "use_regex": True})
    _fuzz(plain, 6000, seed=1)


def test_without_added_tokens_matches_hf(default_backend):
    _fuzz(_variant(default_backend, added_tokens=[]), 2000, seed=2)


def test_long_prose_and_code_match_hf(default_backend):
    fast = FastByteLevelEncoder.build(default_backend)
    rng = random.Random(3)
    words = ["the", "model's", "KV-cache", "x=1;", "\n\n    return", "12.5%", "(a, b)", "it'll",
             "  ", "\t", "<|im_end|>\n"]
    for _ in range(50):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(100, 400)))
        assert fast.encode(text) == default_backend.encode(text).ids


@pytest.mark.parametrize("changes", [
    {"normalizer": {"type": "NFC"}},
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}},
    {"pre_tokenizer": {"type": "Whitespace"}},
    {"post_processor": {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}}], "pair": [
        {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {
        "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}},
])
def test_configurations_it_does_not_reproduce_get_no_fast_path(default_backend, changes):
    assert FastByteLevelEncoder.build(_variant(default_backend, **changes)) is None


@pytest.mark.parametrize("field", ["lstrip", "rstrip", "single_word"])
def test_added_token_with_lstrip_rstrip_or_single_word_gets_no_fast_path(default_backend, field):
    cfg = json.loads(default_backend.to_str())
    cfg["added_tokens"][1][field] = True
    assert FastByteLevelEncoder.build(HFTokenizer.from_str(json.dumps(cfg))) is None


def test_non_special_added_tokens_get_no_fast_path(default_backend):
    # HF matches special tokens first and non-special ones in what is left:
    # with special "bc" and non-special "ab", "abc" is [a, bc], not [ab, c]
    backend = HFTokenizer.from_str(default_backend.to_str())
    backend.add_special_tokens(["bc"])
    backend.add_tokens(["ab"])
    assert FastByteLevelEncoder.build(backend) is None


def test_added_tokens_outside_ascii_do_not_matter(default_backend):
    backend = HFTokenizer.from_str(default_backend.to_str())
    backend.add_special_tokens(["<｜fim▁hole｜>"])
    backend.add_tokens(["ünïcode"])
    fast = FastByteLevelEncoder.build(backend)
    assert fast is not None
    for text in ["<|im_start|>user\nhi 42<|im_end|>", "fim hole <|fim", "unicode 'll"]:
        assert fast.encode(text) == backend.encode(text).ids


def test_truncation_padding_or_encode_special_tokens_get_no_fast_path(default_backend):
    for change in (lambda b: b.enable_truncation(8), lambda b: b.enable_padding(length=16),
                   lambda b: setattr(b, "encode_special_tokens", True)):
        backend = HFTokenizer.from_str(default_backend.to_str())
        change(backend)
        assert FastByteLevelEncoder.build(backend) is None


def test_long_pieces_are_encoded_but_not_cached(default_backend):
    fast = FastByteLevelEncoder.build(default_backend)
    text = " " + "x" * 1000 + " " + "ab" * 50
    assert fast.encode(text) == default_backend.encode(text).ids
    assert all(len(piece) <= fast.MAX_CACHED_PIECE_CHARS for piece in fast._cache)


def test_tokenizer_sends_non_ascii_text_to_hf():
    tok = Tokenizer.from_path(resolve_default_model())
    assert tok._fast is not None
    for text in ["héllo wörld 12", "emoji 😀 and 'll", "nbsp\u00a0x", "ascii only 'll 42",
                 "literal ĠĠ Ċ byte chars"]:
        assert tok.encode(text) == tok.backend.encode(text).ids
