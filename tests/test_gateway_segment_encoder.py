"""SegmentEncoder: cached segments never change a single token id."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.trainers import BpeTrainer

from sluice.default_model import resolve_model
from sluice.gateway.prompt.segment_cache import SegmentEncoder
from sluice.tokenizer import Tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = ["Hello", " world", "  ", "\n", "\n\n", "12", "345", " déjà", "vu", ",", " 'll",
         "\t", "😀", "system", "user", " a", "ab", "<|im", "_start|>"]


def _metaspace(scheme: str) -> Tokenizer:
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    hf.decoder = decoders.Metaspace(prepend_scheme=scheme)
    corpus = ["Hello world, hello again", "a user and a system", "déjà vu 12 345"] * 20
    hf.train_from_iterator(corpus, BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    hf.add_special_tokens(SPECIALS)
    return Tokenizer(hf, bos_token_id=None, eos_token_id=None)


def _lstrip_token() -> Tokenizer:
    hf = HFTokenizer.from_str(Tokenizer.from_path(resolve_model("default")).backend.to_str())
    hf.add_special_tokens([AddedToken("<tool>", lstrip=True)])
    return Tokenizer(hf, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def tokenizers_under_test() -> dict[str, Tokenizer]:
    return {"default": Tokenizer.from_path(resolve_model("default")),
            "metaspace_first": _metaspace("first"), "metaspace_always": _metaspace("always"),
            "lstrip": _lstrip_token()}


pieces = st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(SPECIALS),
                            st.text(max_size=6)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(parts=pieces, min_chars=st.integers(1, 24))
def test_equals_a_plain_encode(tokenizers_under_test, parts, min_chars) -> None:
    text = "".join(parts)
    for name, tok in tokenizers_under_test.items():
        enc = SegmentEncoder(tok, min_chars=min_chars)
        want = tok.encode(text, add_special_tokens=False)
        assert enc.encode(text) == want, name
        assert enc.encode(text) == want, name  # again, from the cache


def test_enabled_only_where_cuts_are_exact(tokenizers_under_test) -> None:
    enabled = {n: SegmentEncoder(t).enabled for n, t in tokenizers_under_test.items()}
    assert enabled["default"] and not enabled["lstrip"]
    assert not enabled["metaspace_first"]  # its first piece alone gets the "▁" prefix


def test_shared_system_prompt_is_encoded_once() -> None:
    tok = Tokenizer.from_path(resolve_model("default"))
    enc = SegmentEncoder(tok, min_chars=64, max_cached_tokens=10_000)
    system = "You answer questions about rivers, in detail and politely. " * 20
    for question in ("Which is the longest?", "Which carries the most water?", "Name three."):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert enc.encode(text) == tok.encode_chat(messages)
    assert (enc.misses, enc.hits) == (1, 2)


def test_cache_stays_within_its_token_bound() -> None:
    tok = Tokenizer.from_path(resolve_model("default"))
    enc = SegmentEncoder(tok, min_chars=8, max_cached_tokens=50)
    for i in range(40):
        text = f"<|im_start|>segment number {i} with a few words<|im_end|>"
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
        assert enc._cached_tokens <= 50 or len(enc._cache) == 1
    assert 1 <= len(enc._cache) < 40
