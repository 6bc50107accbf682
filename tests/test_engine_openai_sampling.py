"""The OpenAI API as vLLM serves it, through the real `openai` SDK against a real engine
process (tiny random model, SmolLM2's tokenizer and template): the sampling fields vLLM
accepts, /tokenize and /detokenize, and unknown fields (a 400 naming them, or ignored and
logged once with --allow-unknown-fields).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from engine_server import EngineProcess

pytestmark = pytest.mark.slow  # engine processes
MODEL = "tiny-chat"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
EOS, IM_START = 2, 1  # SmolLM2's <|im_end|> and <|im_start|>


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "256", "--max-model-len", "1024").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", CHAT), **kw)


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", "Hello"), **kw)


# -- sampling fields ------------------------------------------------------------------------
def test_min_tokens_holds_exactly(client):
    force_eos = {str(EOS): 100}
    assert complete(client, max_tokens=30, logit_bias=force_eos).usage.completion_tokens == 1
    for n in (3, 12):
        r = complete(client, max_tokens=30, logit_bias=force_eos, extra_body={"min_tokens": n})
        assert r.usage.completion_tokens == n + 1 and r.choices[0].finish_reason == "stop"
    r = chat(client, max_completion_tokens=30, logit_bias=force_eos,
             extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6


def _token_str(engine, token: int) -> str:
    return httpx.post(engine.url + "/detokenize", json={"tokens": [token]}).json()["prompt"]


def token_ids(engine, text: str) -> list[int]:
    return httpx.post(engine.url + "/tokenize", json={
        "prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_logit_bias_bans_and_forces(engine, client):
    kw = {"max_tokens": 6, "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    first = complete(client, **kw).choices[0].logprobs.tokens[0]
    first_id = token_ids(engine, first)[0]
    banned = complete(client, logit_bias={str(first_id): -100}, **kw).choices[0]
    assert banned.logprobs.tokens[0] != first
    forced = complete(client, logit_bias={"300": 100}, **kw).choices[0]
    assert forced.logprobs.tokens == [_token_str(engine, 300)] * 6
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        complete(client, max_tokens=2, logit_bias={"99999999": 5})
    with pytest.raises(openai.BadRequestError):
        complete(client, max_tokens=2, logit_bias={"5": 101})


def test_allowed_token_ids_and_bad_words(engine, client):
    allowed = [300, 301, 302]
    strs = {httpx.post(engine.url + "/detokenize", json={"tokens": [t]}).json()["prompt"]
            for t in allowed}
    r = complete(client, max_tokens=8, temperature=1.0, seed=1, logprobs=0,
                 extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    tokens = r.choices[0].logprobs.tokens
    assert len(tokens) == 8 and set(tokens) <= strs and len(set(tokens)) > 1
    kw = {"max_tokens": 8, "temperature": 0, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    first = complete(client, **kw).choices[0].logprobs.tokens[0]
    assert first.strip(), "a visible first token to ban"
    banned = complete(client, **{**kw, "extra_body": {"ignore_eos": True,
                                                      "bad_words": [first.strip()]}})
    assert first not in banned.choices[0].logprobs.tokens


def test_skip_special_tokens(client):
    kw = {"max_tokens": 3, "logit_bias": {str(IM_START): 100}}
    assert complete(client, **kw, extra_body={"ignore_eos": True}).choices[0].text == ""
    kept = complete(client, **kw, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                              "spaces_between_special_tokens": False})
    assert kept.choices[0].text == "<|im_start|>" * 3


def test_echo_and_prompt_logprobs(client):
    r = complete(client, prompt="Once upon a time", max_tokens=3, echo=True, logprobs=1,
                 extra_body={"ignore_eos": True})
    c = r.choices[0]
    n_prompt = r.usage.prompt_tokens
    assert c.text.startswith("Once upon a time") and len(c.logprobs.tokens) == n_prompt + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.token_logprobs[1] < 0
    only = complete(client, prompt="Once upon a time", max_tokens=0, echo=True)
    assert only.choices[0].text == "Once upon a time"
    r = complete(client, prompt="Once upon a time", max_tokens=2,
                 extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    assert all(2 <= len(e) <= 3 and all(v["rank"] >= 1 for v in e.values()) for e in plp[1:])
    r = chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert len(r.model_extra["prompt_logprobs"]) == r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="stream"):
        complete(client, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})


def test_chat_logprobs_equal_the_completions_path(engine, client):
    """The same prompt ids through chat and through completions: same tokens, same logprobs."""
    ids = httpx.post(engine.url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    c = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True}).choices[0].logprobs.content
    p = complete(client, prompt=ids, max_tokens=5, temperature=0, logprobs=3,
                 extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [t.token for t in c] == p.tokens
    assert [t.logprob for t in c] == pytest.approx(p.token_logprobs, abs=1e-5)
    for chat_top, comp_top in zip(c, p.top_logprobs):
        assert {t.token: t.logprob for t in chat_top.top_logprobs} == pytest.approx(comp_top)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        chat(client, max_tokens=2, top_logprobs=2)


def test_max_completion_tokens_and_continuous_usage(client):
    r = chat(client, max_completion_tokens=7, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7
    chunks = list(chat(client, max_completion_tokens=5, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5


# -- /tokenize, /detokenize, unknown fields -------------------------------------------------
def test_tokenize_and_detokenize(engine):
    t = httpx.post(engine.url + "/tokenize", json={"prompt": "Hello world",
                                                   "return_token_strs": True}).json()
    assert t["token_strs"] == ["Hello", "Ġworld"] and t["count"] == 2
    d = httpx.post(engine.url + "/detokenize", json={"model": MODEL, "tokens": t["tokens"]})
    assert d.json() == {"prompt": "Hello world"}
    assert httpx.post(engine.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    chat_ids = httpx.post(engine.url + "/tokenize", json={
        "messages": [*CHAT, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()["tokens"]
    text = httpx.post(engine.url + "/detokenize", json={"tokens": chat_ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nIt is")


def test_unknown_fields_are_400_harmless_ones_pass(client):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, max_tokens=2, extra_body={"best_of": 2, "frobnicate": True})
    assert err.value.body["param"] == "best_of" and "frobnicate" in err.value.body["message"]
    assert chat(client, max_tokens=2, metadata={"k": "v"}, store=False, user="u").choices


def test_allow_unknown_fields_logs_each_name_once(tiny_chat_model, tmp_path):
    log = tmp_path / "engine.log"
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "64", "--max-model-len", "512",
                         "--allow-unknown-fields", log_path=log).wait_ready()
    try:
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            assert c.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                        extra_body={"best_of": 2}).choices
    finally:
        proc.stop()
    assert log.read_text().count("best_of") == 1
