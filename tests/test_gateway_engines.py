"""The picker behind a real Envoy, in front of real engine processes (tiny model), with a
real redis-server."""

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest
import redis
from fake_engine import engine_with_events
from picker_harness import Front
from prometheus_client import generate_latest
from redis_server import RedisServer
from routing_testing import shipped

from sluice import index_keys as ik
from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import StaticDiscovery, parse_engine_spec
from sluice.gateway.prompt.block_keys import request_keys
from sluice.gateway.prompt.tokenize import PromptTokenizer

pytestmark = pytest.mark.slow  # engine processes behind the picker

MODEL = "tiny-chat"
SYSTEM = ("You are a meticulous assistant. " * 30).strip()


def chat(i, system=SYSTEM):
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Question number {i}: name a colour."}]


@pytest.fixture(scope="module")
def redis_srv():
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def engines(tiny_chat_model):
    started = [engine_with_events(str(tiny_chat_model), MODEL) for _ in range(2)]
    for proc, _ in started:
        proc.wait_ready()
    yield started
    for proc, _ in started:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(engines, redis_srv, tiny_chat_model):
    # No speculative entries: every prefix hit below comes from the engines' events.
    cfg = CoreConfig(routing_document=shipped("kv_aware", speculative_ttl_ms=0),
                     redis_url=redis_srv.url, redis_timeout_s=0.2)
    gw = RoutingCore(cfg, StaticDiscovery([parse_engine_spec(s) for _, s in engines]),
                     PromptTokenizer.from_paths([str(tiny_chat_model)]))
    with Front(gw) as front:
        deadline = time.time() + 20
        while httpx.get(front.url + "/v1/models").json()["data"] == [] or \
                len(gw.loads.fresh(time.time() * 1000)) < 2:
            assert time.time() < deadline
            time.sleep(0.1)
        yield front


def complete(url, messages, max_tokens=4):
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def wait_indexed(gateway, ids, timeout=20.0):
    """Until some pod's events cover every full block of `ids` in the local view."""
    keys = request_keys(MODEL, 16, ids)
    pods = list(gateway.gw.registry.active())
    deadline = time.time() + timeout
    while max(gateway.gw.index.local.lookup(keys, pods, time.time() * 1000).values(),
              default=0) < len(keys):
        assert time.time() < deadline, "the engine's KV events did not reach the index"
        time.sleep(0.05)


def test_openai_sdk_streams_through_gateway(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    stream = client.chat.completions.create(model=MODEL, messages=chat(0), max_tokens=8,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat(0),
                                                           max_tokens=2)
    assert raw.headers["x-sluice-strategy"] == "kv_aware"
    assert raw.headers["x-sluice-pod"] in [s.split("//")[1] for s in gateway.gw.registry.active()
                                          .values()]


def test_gateway_and_engine_agree_on_token_ids(gateway):
    """Event-fed hits can only match when the gateway's chat-template rendering and
    tokenization equal the engine's for every full block."""
    messages = chat(1, system="A different system prompt, long enough. " * 20)
    ids = gateway.gw.tokenizer.token_ids("chat", {"model": MODEL, "messages": messages})
    first = complete(gateway.url, messages)
    assert first.json()["usage"]["prompt_tokens"] == len(ids)
    assert first.headers["x-sluice-prefix-hit-blocks"] == "0"
    wait_indexed(gateway, ids)
    second = complete(gateway.url, messages)
    assert second.headers["x-sluice-pod"] == first.headers["x-sluice-pod"]
    assert int(second.headers["x-sluice-prefix-hit-blocks"]) == len(ids) // 16
    # OpenAI content parts and null fields: rendered as the engine renders them
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief. " * 30},
                                            {"type": "text", "text": "Really."}], "name": None},
             {"role": "user", "content": "Name a colour.", "tool_calls": None}]
    ids = gateway.gw.tokenizer.token_ids("chat", {"model": MODEL, "messages": parts})
    assert complete(gateway.url, parts).json()["usage"]["prompt_tokens"] == len(ids)


def test_shared_prefix_sticks_to_the_pod_that_holds_it(gateway):
    system = "Shared instructions for the whole group of users. " * 12
    pods = {complete(gateway.url, chat(100, system)).headers["x-sluice-pod"]}
    wait_indexed(gateway, gateway.gw.tokenizer.token_ids(
        "chat", {"model": MODEL, "messages": chat(100, system)}))
    for i in range(101, 106):
        r = complete(gateway.url, chat(i, system))
        pods.add(r.headers["x-sluice-pod"])
        assert int(r.headers["x-sluice-prefix-hit-blocks"]) > 0
    assert len(pods) == 1


def test_loads_are_shared_in_redis_with_ttl(gateway, redis_srv):
    r = redis.Redis(port=redis_srv.port)
    messages = chat(300)
    complete(gateway.url, messages)  # so at least one pod has sent events
    wait_indexed(gateway, gateway.gw.tokenizer.token_ids(
        "chat", {"model": MODEL, "messages": messages}))
    deadline = time.time() + 10  # Redis is written right after the local view
    while not any(r.scard(ik.pod_keys_key(p)) for p in gateway.gw.registry.active()):
        assert time.time() < deadline
        time.sleep(0.05)
    with_events = 0
    for pod in gateway.gw.registry.active():
        row = ik.parse_load(r.hgetall(ik.load_key(pod)))
        assert row is not None and 0 <= row["kv_usage"] <= 1
        assert 0 < r.pttl(ik.load_key(pod)) <= 1000
        if r.scard(ik.pod_keys_key(pod)):  # the block size comes with the events
            with_events += 1
            assert r.hget(ik.pod_meta_key(pod), "block_size") == b"16"
    assert with_events >= 1


def test_redis_killed_mid_run_falls_back_and_recovers(gateway, redis_srv):
    def ok(i):
        return complete(gateway.url, chat(200 + i)).status_code == 200

    redis_srv.stop()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            assert all(pool.map(ok, range(8)))
        metrics = gateway.picker.call(
            lambda: generate_latest(gateway.gw.metrics.registry).decode())
        assert 'sluice_gateway_index_mode{mode="local"} 1.0' in metrics
        health = httpx.get(gateway.url + "/health").json()
        assert health["index"] == "local" and health["event_feed"] == "running"
    finally:
        redis_srv.start()
    deadline = time.time() + 10
    while httpx.get(gateway.url + "/health").json()["index"] != "redis":
        assert time.time() < deadline
        time.sleep(0.1)
    r = redis.Redis(port=redis_srv.port)
    assert sum(r.scard(ik.pod_keys_key(p)) for p in gateway.gw.registry.active()) > 0
    assert ok(300)


def test_engine_killed_mid_stream_ends_stream_with_error(tiny_chat_model):
    proc, spec = engine_with_events(str(tiny_chat_model), MODEL, "--max-num-seqs", "4")
    proc.wait_ready()
    gw = RoutingCore(CoreConfig(routing="round_robin"),
                     StaticDiscovery([parse_engine_spec(spec)]))
    try:
        with Front(gw) as front:
            events = []
            t0 = time.time()
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000,
                    "ignore_eos": True, "stream": True}
            with pytest.raises(httpx.RemoteProtocolError), \
                    httpx.stream("POST", front.url + "/v1/completions", timeout=30,
                                 json=body) as r:  # cut: an error, never a hang
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            proc.proc.kill()
            assert time.time() - t0 < 20
            assert len(events) >= 3 and "[DONE]" not in events
    finally:
        proc.stop()


def test_a_flood_of_hostile_requests_leaves_every_normal_request_served(gateway):
    """The security issue's repro: prompts with lone surrogates (and other input the
    engines refuse) sent beside normal traffic. Each gets an OpenAI-shaped 4xx; the
    normal requests all succeed and no pod is marked unhealthy."""
    hostile = [
        b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL.encode(),
        b'{"model": "%s", "messages": [{"role": "user", "content": "x\\udfffy"}]}'
        % MODEL.encode(),
        json.dumps({"model": MODEL, "prompt": "word " * 5000, "max_tokens": 2}).encode(),
    ]

    def attack(i):
        path = "/v1/chat/completions" if b"messages" in hostile[i % 3] else "/v1/completions"
        r = httpx.post(gateway.url + path, content=hostile[i % 3], timeout=60,
                       headers={"content-type": "application/json"})
        err = r.json()["error"]
        return r.status_code, set(err), err["code"]

    def normal(i):
        return complete(gateway.url, chat(400 + i), max_tokens=2).status_code

    with cf.ThreadPoolExecutor(6) as pool:
        attacks = pool.map(attack, range(24))
        served = pool.map(normal, range(35))
        answers, codes = list(attacks), list(served)
    assert codes == [200] * 35
    for status, keys, code in answers:
        assert 400 <= status < 500 and code == status
        assert keys == {"message", "type", "param", "code"}
    assert all(httpx.get(gateway.url + "/health").json()["pods"].values())


def test_a_picker_without_a_tokenizer_tokenizes_through_the_pods(engines, redis_srv):
    """No --tokenizer: the picker asks a pod's /tokenize, and its keys match the events."""
    cfg = CoreConfig(routing_document=shipped("kv_aware", speculative_ttl_ms=0),
                     redis_url=redis_srv.url, redis_timeout_s=0.2)
    gw = RoutingCore(cfg, StaticDiscovery([parse_engine_spec(s) for _, s in engines]))
    with Front(gw) as front:
        deadline = time.time() + 20
        while len(gw.loads.fresh(time.time() * 1000)) < 2:
            assert time.time() < deadline
            time.sleep(0.1)
        messages = chat(700, system="Instructions only this test sends. " * 15)
        first = complete(front.url, messages)
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        deadline = time.time() + 20
        while True:  # until the first answer's blocks are indexed from the events
            again = complete(front.url, messages)
            if int(again.headers["x-sluice-prefix-hit-blocks"]) == (prompt_tokens - 1) // 16:
                break
            assert time.time() < deadline, again.headers
            time.sleep(0.1)
        assert again.headers["x-sluice-pod"] == first.headers["x-sluice-pod"]
        assert gw.metrics.errors.labels("tokenize")._value.get() == 0


def test_inflight_ends_when_the_response_really_ends(gateway):
    """Through a real Envoy: streamed, whole, and a client gone mid-stream."""
    flight = gateway.gw.flight

    def inflight():
        return gateway.picker.call(lambda: dict(flight.inflight))

    complete(gateway.url, chat(800))
    wait_idle = time.time() + 10
    while inflight():
        assert time.time() < wait_idle
        time.sleep(0.02)
    body = {"model": MODEL, "prompt": "A story", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        assert sum(inflight().values()) == 1  # held while the answer streams
    deadline = time.time() + 10
    while inflight():  # the client left: Envoy ends the picker's stream
        assert time.time() < deadline, inflight()
        time.sleep(0.02)
