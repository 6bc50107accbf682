"""IncrementalDetokenizer: streamed deltas add up to decode() of the whole output,
and no delta shows U+FFFD for a character whose bytes are still arriving."""

from __future__ import annotations

import random

import pytest

from sluice.default_model import resolve_default_model
from sluice.tokenizer import IncrementalDetokenizer, Tokenizer

MULTI_BYTE_TEXTS = [
    "😀👍🏽🇺🇸",
    "你好，世界！",
    "Ångström façade ²³",
    "مرحبا",
    "🎉 ok 🎉",
    "한국어 텍스트",
    "x\u200by",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(resolve_default_model())


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add_token(i) for i in output]
    deltas.append(detok.finish())
    assert detok.output_text == "".join(deltas)
    assert detok.output_token_ids == output
    return deltas


def _byte_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of single-byte tokens for UTF-8 lead and continuation bytes (0x80..0xF4)."""
    ids = [
        i
        for i in range(tok.vocab_size)
        if len(s := tok.convert_ids_to_tokens([i])[0]) == 1 and ord(s) >= 0xA1
    ]
    assert len(ids) > 50
    return ids


def test_valid_text_streams_without_replacement_chars(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Say something in emoji"}])
    for text in MULTI_BYTE_TEXTS + [" ".join(MULTI_BYTE_TEXTS)]:
        output = tok.encode(text, add_special_tokens=False) + [2]
        deltas = _stream(tok, prompt, output)
        assert "".join(deltas) == tok.decode(output) == text
        assert not any("\ufffd" in d for d in deltas), deltas


def test_one_token_per_byte(tok: Tokenizer) -> None:
    from sluice.gguf_tokenizer import bytes_to_unicode as _bytes_to_unicode

    spelling = _bytes_to_unicode()
    for text in MULTI_BYTE_TEXTS:
        output = [tok.backend.token_to_id(spelling[b]) for b in text.encode()]
        assert None not in output
        deltas = _stream(tok, [], output)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
        assert sum(1 for d in deltas if d) == len(text)  # one delta per completed character


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_add_up_to_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    byte_ids = _byte_token_ids(tok)
    text_ids = [i for t in MULTI_BYTE_TEXTS for i in tok.encode(t, False)]
    special = [0, 1, 2]
    for _ in range(300):
        output = []
        for _ in range(rng.randrange(1, 25)):
            pool = rng.choice((byte_ids, text_ids, special, range(tok.vocab_size)))
            output.append(rng.choice(pool))
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        expected = tok.decode(output, skip_special_tokens=skip)
        deltas = _stream(tok, prompt, output, skip)
        assert "".join(deltas) == expected, (prompt, output)
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas)


def test_held_back_bytes_are_flushed_by_finish(tok: Tokenizer) -> None:
    from sluice.gguf_tokenizer import bytes_to_unicode as _bytes_to_unicode

    spelling = _bytes_to_unicode()
    lead = tok.backend.token_to_id(spelling[0xF0])  # first byte of a 4-byte character
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert detok.add_token(tok.encode("A", False)[0]) == "A"
    assert detok.add_token(lead) == ""
    assert detok.finish() == "\ufffd" == tok.decode([lead])
    assert detok.finish() == ""


def test_prompt_ending_mid_character(tok: Tokenizer) -> None:
    from sluice.gguf_tokenizer import bytes_to_unicode as _bytes_to_unicode

    spelling = _bytes_to_unicode()
    emoji = [tok.backend.token_to_id(spelling[b]) for b in "😀".encode()]
    prompt = tok.encode("Hi") + emoji[:2]
    output = emoji[2:] + tok.encode(" ok", False)
    deltas = _stream(tok, prompt, output)
    assert "".join(deltas) == tok.decode(output) == "\ufffd\ufffd ok"
