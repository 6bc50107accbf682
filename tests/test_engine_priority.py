"""`--scheduling-policy priority` in a real `sluice engine` process: the gateway's
`x-sluice-priority` header (GIE's convention, higher first) and the body's `priority`
(vLLM's, lower first) order the requests; a bad one is a 400 in OpenAI's shape."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import openai
import pytest
from engine_server import EngineProcess

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "256", "--max-model-len", "1024",
                         "--scheduling-policy", "priority", "--max-num-seqs", "1").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def finish_times(client, specs: list[tuple[str, int, dict, dict]]) -> dict[str, float]:
    """Start each (name, max_tokens, headers, extra body) 0.1 s after the previous one
    (one seat: each queues behind the first); when each finished."""
    def run(max_tokens: int, headers: dict, body: dict) -> float:
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens,
                                  temperature=0, extra_headers=headers,
                                  extra_body={"ignore_eos": True, **body})
        return time.monotonic()

    with cf.ThreadPoolExecutor(len(specs)) as pool:
        futures = {}
        for name, max_tokens, headers, body in specs:
            futures[name] = pool.submit(run, max_tokens, headers, body)
            time.sleep(0.1)
        return {name: f.result(timeout=120) for name, f in futures.items()}


def test_a_higher_priority_preempts_and_equal_ones_keep_their_order(client):
    done = finish_times(client, [
        ("long", 900, {}, {}),
        ("queued", 4, {}, {}),
        ("urgent", 4, {"x-sluice-priority": "10"}, {}),
    ])
    assert done["urgent"] < done["long"] < done["queued"], done


def test_the_gateway_header_wins_over_the_body(client):
    done = finish_times(client, [
        ("long", 900, {}, {}),
        ("claims", 4, {"x-sluice-priority": "0"}, {"priority": -50}),
        ("body", 4, {}, {"priority": -5}),
    ])
    assert done["body"] < done["long"] < done["claims"], done


@pytest.mark.parametrize("header", ["high", "9" * 20, "1.5"])
def test_a_bad_priority_header_is_a_400(engine, header):
    r = httpx.post(engine.url + "/v1/completions", headers={"x-sluice-priority": header},
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-sluice-priority"


def test_a_priority_out_of_bounds_is_a_400(engine):
    r = httpx.post(engine.url + "/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": 2**40})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
