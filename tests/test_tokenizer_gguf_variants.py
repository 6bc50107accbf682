"""GGUF tokenizer metadata variants (pre-tokenizer families, BOS/EOS flags,
user-defined and mislabelled tokens) against transformers' GGUF tokenizer, on
small GGUF files cut from the SmolLM2 vocabulary."""

from __future__ import annotations

import os

import pytest

from sluice.default_model import resolve_default_model
from sluice.gguf_tokenizer import gguf_field
from sluice.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

KEEP = 3000  # the first ids: 17 control tokens, 256 bytes, then the most frequent merges
TEXTS = [
    "Hello world, I'm here and they'll see.",
    "numbers 1 12 123 1234 12345 and  9  spaces",
    "line one\n\n  line two\r\n\tindented",
    "ünïcödé 😀 你好",
    "<|im_start|>user\nhi<|im_end|>",
    "<jupyter_text> and <jupyter_code> inline",
    "",
]


@pytest.fixture(scope="module")
def small_vocab() -> dict:
    reader = gguf.GGUFReader(resolve_default_model())
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")[:KEEP]
    kept = set(tokens)
    merges = [
        m
        for m in gguf_field(reader, "tokenizer.ggml.merges")
        if (parts := m.split(" "))
        and parts[0] in kept
        and parts[1] in kept
        and "".join(parts) in kept
    ]
    types = gguf_field(reader, "tokenizer.ggml.token_type")[:KEEP]
    assert len(merges) > 2000
    return {
        "tokens": tokens,
        "merges": merges,
        "types": types,
        "template": gguf_field(reader, "tokenizer.chat_template"),
    }


def _write(
    path: str,
    vocab: dict,
    *,
    pre: str,
    add_bos: bool,
    add_eos: bool,
    retype: dict[int, int],
    rename: dict[int, str],
) -> None:
    tokens = [rename.get(i, t) for i, t in enumerate(vocab["tokens"])]
    types = [retype.get(i, t) for i, t in enumerate(vocab["types"])]
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16),
        (writer.add_head_count, 2),
        (writer.add_head_count_kv, 1),
        (writer.add_vocab_size, len(tokens)),
    ):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    writer.add_chat_template(vocab["template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


@pytest.mark.parametrize(
    "pre,add_bos,add_eos",
    [
        ("llama-bpe", True, False),
        ("qwen2", False, True),
        ("gpt-2", True, True),
        ("some-future-pre", False, False),  # unknown: GPT-2's split, as transformers does
    ],
)
def test_variant_matches_transformers(
    tmp_path, small_vocab, pre: str, add_bos: bool, add_eos: bool
) -> None:
    path = str(tmp_path / "tok.gguf")
    # 12 '<jupyter_text>': user-defined (matched whole, not special);
    # 13 '<jupyter_code>' renamed with a space: a control token outside the byte
    # alphabet, which both sides drop (it is a llama.cpp mislabel).
    _write(
        path,
        small_vocab,
        pre=pre,
        add_bos=add_bos,
        add_eos=add_eos,
        retype={12: 4},
        rename={13: "<jupyter code>"},
    )
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    ours = Tokenizer.from_path(path)
    for text in TEXTS:
        pieces = ours.backend.pre_tokenizer.pre_tokenize_str(text)
        assert pieces == ref.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text), text
        for special in (True, False):
            ids = ours.encode(text, special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), (
                    text,
                    skip,
                )
    assert ours.encode("x")[:1] == ([1] if add_bos else ours.encode("x", False)[:1])
    assert (ours.encode("x")[-1] == 2) == add_eos
    assert ours.encode("<jupyter_text>", False) == [12]
    assert ours.eos_token_ids == frozenset({2, 0})  # eos plus llama.cpp's end-of-turn id
    assert ours.vocab_size == len(ref) == KEEP
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_unsupported_tokenizer_model_is_an_error(tmp_path) -> None:
    path = str(tmp_path / "spm.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'t5' is not supported"):
        Tokenizer.from_path(path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_path(os.fspath(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Tokenizer.from_path(os.fspath(tmp_path / "config.json"))
