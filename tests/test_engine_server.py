"""The OpenAI server of a real `sluice engine` process, driven by the real `openai` SDK."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import httpx
import openai
import pytest
from engine_server import EngineProcess
from polling import wait_for

MODEL = "tiny-chat"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "256", "--max-model-len", "1024").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def test_models_and_health(engine, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(engine.url + "/health").status_code == 200


def test_chat_non_streaming_usage_and_length(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7,
                                       temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_stream_equals_non_stream(client):
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_roles_and_text(client):
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_stop_sequence_cuts_text(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop],
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text


def test_seed_reproducible(client):
    def run(seed):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=12,
                                         temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert run(7) == run(7)
    assert len({run(s) for s in (1, 2, 3)}) > 1


def test_n_choices(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], n=3, max_tokens=6,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.completion_tokens == 36
    assert len({c.text for c in r.choices[:3]}) > 1, "the n samples of one prompt differ"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for tok, lp_value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert lp_value <= 0 and abs(max(top.values()) - lp_value) < 1e-4
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                       logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.content) == 2
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 3


def test_errors(engine, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=5)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * 2000, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    r = httpx.post(engine.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(engine.url + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # The server still works after bad requests.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def _running_and_usage(engine):
    return engine.metric("vllm:num_requests_running"), engine.metric("vllm:kv_cache_usage_perc")


def test_client_disconnect_frees_blocks(engine):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
            "ignore_eos": True, "temperature": 0}
    aborted = engine.metric("vllm:request_success_total", 'finished_reason="abort"')
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            assert next(lines) is not None
        assert _running_and_usage(engine)[0] == 1
    deadline = time.time() + 10
    while time.time() < deadline and _running_and_usage(engine) != (0.0, 0.0):
        time.sleep(0.1)
    assert _running_and_usage(engine) == (0.0, 0.0)
    assert engine.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted + 1


def test_client_gone_from_a_streamed_n_request_aborts_every_choice_cleanly(engine):
    body = {"model": MODEL, "prompt": "Tell me three long stories", "max_tokens": 900, "n": 3,
            "stream": True, "ignore_eos": True}
    aborted = engine.metric("vllm:request_success_total", 'finished_reason="abort"')
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            assert next(lines) is not None
    deadline = time.time() + 10
    while time.time() < deadline and _running_and_usage(engine) != (0.0, 0.0):
        time.sleep(0.1)
    assert _running_and_usage(engine) == (0.0, 0.0)
    assert engine.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted + 3
    assert "Traceback" not in engine.log_path.read_text()


def test_non_streaming_disconnect_aborts(engine):
    """A client that closes its connection while a non-streamed request is generating: the
    engine aborts it (counted as finished_reason="abort") and frees its blocks."""
    body = json.dumps({"model": MODEL, "prompt": "Count forever", "max_tokens": 900,
                       "n": 16, "ignore_eos": True}).encode()
    aborted = engine.metric("vllm:request_success_total", 'finished_reason="abort"')
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: _running_and_usage(engine)[0] >= 1, timeout=10)
    wait_for(lambda: _running_and_usage(engine) == (0.0, 0.0), timeout=10)
    assert engine.metric("vllm:request_success_total", 'finished_reason="abort"') > aborted


def test_with_a_key_only_probes_and_scrapes_are_open_and_admin_needs_it(tiny_chat_model):
    keyed = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                          "--num-kv-blocks", "64", "--max-model-len", "512",
                          "--api-key", "sk-engine").wait_ready()
    try:
        url, auth = keyed.url, {"authorization": "Bearer sk-engine"}
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("POST", "/reset_prefix_cache"), ("GET", "/openapi.json"),
                             ("GET", "/docs"), ("POST", "/tokenize")):
            for headers in (None, {"authorization": "Bearer sk-wrong"}):
                r = httpx.request(method, url + path, headers=headers, json={})
                assert r.status_code == 401, (path, r.text)
                assert r.json()["error"]["code"] == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-engine", max_retries=0)
        client.completions.create(model=MODEL, prompt="A shared prefix " * 8, max_tokens=1)
        assert httpx.post(url + "/reset_prefix_cache", headers=auth).status_code == 200
        before = keyed.metric("vllm:prefix_cache_hits_total")
        client.completions.create(model=MODEL, prompt="A shared prefix " * 8, max_tokens=1)
        assert keyed.metric("vllm:prefix_cache_hits_total") == before, "nothing cached now"
        assert httpx.get(url + "/openapi.json", headers=auth).status_code == 200
    finally:
        keyed.stop()


def test_without_a_key_the_admin_endpoints_and_docs_are_not_served(engine):
    for method, path in (("POST", "/reset_prefix_cache"), ("GET", "/openapi.json"),
                         ("GET", "/docs"), ("GET", "/redoc")):
        r = httpx.request(method, engine.url + path)
        assert r.status_code == 404 and r.json()["error"]["code"] == 404, path


def test_metrics_names(engine):
    text = httpx.get(engine.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket"):
        assert name in text, name
    assert f'model_name="{MODEL}"' in text and 'num_gpu_blocks="256"' in text


def test_overload_answers_429(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "64", "--max-num-seqs", "1",
                         "--max-waiting-requests", "2").wait_ready()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True}

        def post(_):
            return httpx.post(proc.url + "/v1/completions", json=body, timeout=60)

        with cf.ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(post, range(12)))
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes, codes
        limited = next(r for r in responses if r.status_code == 429)
        assert limited.headers["retry-after"] and limited.json()["error"]["code"] == 429
        assert set(codes) <= {200, 429}
    finally:
        proc.stop()


def test_generation_config_defaults(tiny_chat_model, tmp_path):
    """Fields a request leaves out take generation_config.json's values (vLLM's default)."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "max_new_tokens": 5, "eos_token_id": 2}))
    proc = EngineProcess("--model", str(folder), "--served-model-name", MODEL,
                         "--num-kv-blocks", "64", "--max-model-len", "512").wait_ready()
    plain = EngineProcess("--model", str(folder), "--served-model-name", MODEL,
                          "--num-kv-blocks", "64", "--max-model-len", "512",
                          "--generation-config", "vllm").wait_ready()
    try:
        def ask(p, **kw):
            c = openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
            return c.completions.create(model=MODEL, prompt="Hello", seed=None,
                                        extra_body={"ignore_eos": True}, **kw)
        a, b = ask(proc), ask(proc)
        assert a.usage.completion_tokens == 5  # max_new_tokens
        assert a.choices[0].text == b.choices[0].text  # do_sample false: greedy
        assert ask(proc, max_tokens=7).usage.completion_tokens == 7  # the request wins
        assert ask(plain).usage.completion_tokens > 5  # vllm: no model defaults
    finally:
        proc.stop()
        plain.stop()


def test_tokenize_gives_the_ids_a_completion_would_use(engine, client, tiny_chat_model):
    """vLLM's /tokenize, same request and answer shape: the picker may tokenize through
    it, so it must agree with the engine's own prompt and with the picker's tokenizer."""
    from sluice.gateway.prompt.tokenize import PromptTokenizer

    picker = PromptTokenizer.from_paths([str(tiny_chat_model)])
    chat = httpx.post(engine.url + "/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    assert set(chat) == {"count", "max_model_len", "tokens", "token_strs"}
    assert chat["max_model_len"] == 1024 and chat["count"] == len(chat["tokens"])
    used = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert used.usage.prompt_tokens == chat["count"]
    assert picker.token_ids("chat", {"model": MODEL, "messages": CHAT}) == chat["tokens"]
    text = httpx.post(engine.url + "/tokenize", json={"prompt": "Once upon a time"}).json()
    assert text["tokens"] == picker.token_ids("completion", {"prompt": "Once upon a time"})
    bare = httpx.post(engine.url + "/tokenize",
                      json={"prompt": "Once upon a time", "add_special_tokens": False}).json()
    assert bare["count"] <= text["count"]
    bad = httpx.post(engine.url + "/tokenize", content=b'{"prompt": "a\\ud800b"}',
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def test_fcfs_refuses_a_priority_and_ignores_the_gateways_header(engine):
    url, body = engine.url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(url, json={**body, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert httpx.post(url, json=body, headers={"x-sluice-priority": "10"}).status_code == 200
