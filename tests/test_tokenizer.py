"""sluice.tokenizer against Hugging Face transformers, on the bundled SmolLM2 GGUF
and on an HF folder saved from it."""

from __future__ import annotations

import json
import os
import shutil
import unicodedata

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from sluice.default_model import resolve_default_model
from sluice.gguf_tokenizer import bytes_to_unicode as _bytes_to_unicode
from sluice.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "\t\ttabs and\n\n\nnewlines\r\n",
    "héllo wörld, Ångström façade",
    "emoji 😀👍🏽🇺🇸 ❤️ 🎉🎉🎉",
    "你好，世界！日本語のテキスト 한국어",
    "مرحبا بالعالم Россия и Українa",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say it's fine, WE'VE seen it",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "zero\u200bwidth and\u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<think>tags</think> ĠĠ Ċ literal byte chars",
    "x=1;y=22;z=333",
]
# Whitespace directly before a numeric character: SmolLM2 isolates every digit
# before the GPT-2 split (its tokenizer.json is Digits + ByteLevel, llama.cpp's
# "smollm" pre-tokenizer is "\p{N}" then the GPT-2 regex); transformers' GGUF
# converter uses the plain GPT-2 split, which differs exactly on these.
DIGIT_AFTER_SPACE_TEXTS = ["  1", "x =  5\n", "a  12  345", "١٢٣ ²³", "| 10 |  20 |", "\n  7."]

MULTI_TURN = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2 + 2? Answer in émoji 🤔."},
]
SYSTEM = [{"role": "system", "content": "You are terse.\nVery terse."}]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_default_model()


@pytest.fixture(scope="module")
def ours(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_path(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path: str):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )


@pytest.fixture(scope="module")
def ref_smollm_split(ref) -> HFTokenizer:
    """transformers' tokenizer with SmolLM2's published pre-tokenizer."""
    backend = HFTokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


@pytest.fixture(scope="module")
def hf_folder(ref, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("smollm2_tok"))
    ref.save_pretrained(folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 0]}, f)
    return folder


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_ids_match_transformers(ours, ref, ref_smollm_split, add_special_tokens) -> None:
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == ref.encode(
            text, add_special_tokens=add_special_tokens
        ), text
    for text in TEXTS + DIGIT_AFTER_SPACE_TEXTS:
        expected = ref_smollm_split.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours.encode(text, add_special_tokens) == expected, text


def test_no_merge_touches_a_numeric_character(ours) -> None:
    """Why digits are isolated: the merges were learned with them isolated."""
    merges = json.loads(ours.backend.to_str())["model"]["merges"]
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    assert len(merges) > 40000
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        text = bytes(to_byte[c] for c in "".join(pair)).decode("utf-8", "replace")
        assert len(text) == 1 or not any(unicodedata.category(c).startswith("N") for c in text), (
            pair
        )


def test_gguf_special_tokens_and_template(ours, ref) -> None:
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert ours.eos_token_ids == frozenset({2})
    assert ours.vocab_size == len(ref) == 49152
    assert ours.chat_template == ref.chat_template
    assert ours.convert_ids_to_tokens([1, 19556, 216]) == ref.convert_ids_to_tokens([1, 19556, 216])


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, ref, skip) -> None:
    import random

    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))] + [2]
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours, ref, ref_smollm_split, system, add_generation_prompt
) -> None:
    messages = (SYSTEM if system else []) + MULTI_TURN
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == ref_smollm_split.encode(text, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == len(messages) + (not system)


def test_hf_folder_matches_transformers(hf_folder) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(hf_folder)
    ours = Tokenizer.from_path(hf_folder)
    for text in TEXTS + DIGIT_AFTER_SPACE_TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, False) == ref.encode(text, add_special_tokens=False), text
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.eos_token_ids == frozenset({0, 2})  # generation_config.json adds its eos ids
    assert ours.vocab_size == len(ref)
    for messages in (MULTI_TURN, SYSTEM + MULTI_TURN):
        for gen in (True, False):
            assert ours.apply_chat_template(
                messages, add_generation_prompt=gen
            ) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


TOOL_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}
  {%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {%- if m.role == 'assistant' %}<|im_start|>assistant
{% generation %}{{ m.content | trim }}{% if m.reasoning_content %}[r:{{ m.reasoning_content }}]{% endif %}{% endgeneration %}<|im_end|>
  {%- else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
  {%- endif %}
  {%- if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant [{{ ns.n }} msgs, {{ eos_token }}, {{ flag | default('no-flag') }}]
{% endif %}"""


def test_custom_template_features_match_transformers(hf_folder, tmp_path) -> None:
    folder = tmp_path / "tools"
    shutil.copytree(hf_folder, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_path(str(folder))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": 'Météo <html> & "quotes"',
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = (
        SYSTEM
        + MULTI_TURN[:2]
        + [{"role": "assistant", "content": "  ok  ", "reasoning": "because"}]
    )
    for kwargs in ({}, {"flag": "on"}):
        for gen in (True, False):
            expected = ref.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            assert (
                ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools, **kwargs)
                == expected
            )
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])


def test_no_chat_template_is_a_clear_error(ours) -> None:
    bare = Tokenizer(HFTokenizer.from_str(ours.backend.to_str()), bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(MULTI_TURN)
