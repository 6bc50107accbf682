"""Disaggregated prefill/decode between real `sluice engine` processes over loopback:
vLLM's two-leg flow, llm-d's x-prefiller-host-port, prefix hits on either side, faults.
float32 engines: the disaggregated greedy tokens must equal the plain ones exactly."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import uuid

import httpx
import pytest
from engine_server import EngineProcess
from polling import wait_for

pytestmark = pytest.mark.slow  # engine processes

MODEL = "tiny-chat"
BS = 16
LONG = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(40))  # > 1 chunk
HEADER = "x-prefiller-host-port"


def _kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "SluiceConnector", "kv_role": role, "kv_port": 0,
                       "kv_connector_extra_config": extra})


def _start(tiny_chat_model, role: str, **extra) -> EngineProcess:
    return EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--dtype", "float32", "--num-kv-blocks", "256", "--block-size",
                         str(BS), "--max-model-len", "1024", "--max-num-batched-tokens", "64",
                         "--kv-transfer-config", _kv_config(role, **extra))


@pytest.fixture(scope="module")
def pd(tiny_chat_model):
    engines = [_start(tiny_chat_model, "kv_both", hold_timeout_s=3),
               _start(tiny_chat_model, "kv_both", pull_timeout_s=5)]
    try:
        yield tuple(e.wait_ready() for e in engines)
    finally:
        for e in engines:
            e.stop()


def _body(prompt, max_tokens=12, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}


def _post(engine, body, path="/v1/completions", headers=None):
    return httpx.post(engine.url + path, json=body, headers=headers, timeout=120)


def plain(engine, prompt, n=12) -> str:
    """The reference: this engine alone, with a salt no other request shares."""
    r = _post(engine, _body(prompt, n, cache_salt=f"ref-{uuid.uuid4().hex}"))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def prefill_leg(prefill, prompt, **kw):
    r = _post(prefill, _body(prompt, 1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}, **kw))
    assert r.status_code == 200, r.text
    return r.json()


def two_legs(prefill, decode, prompt, n=12, **kw):
    first = prefill_leg(prefill, prompt, **kw)
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    r = _post(decode, _body(prompt, n, kv_transfer_params=params, **kw))
    assert r.status_code == 200, r.text
    return first, r.json()


def _held(engine) -> float:
    return engine.metric("sluice:kv_blocks_held_for_remote")


@pytest.mark.parametrize("prompt", ["The quick brown fox", LONG])
def test_disaggregated_equals_plain(pd, prompt):
    prefill, decode = pd
    pulled = prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')
    received = decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"')
    first, answer = two_legs(prefill, decode, prompt)
    assert answer["choices"][0]["text"] == plain(decode, prompt)
    n = first["usage"]["prompt_tokens"]
    assert len(first["kv_transfer_params"]["remote_block_ids"]) == -(-n // BS)
    assert answer["usage"]["prompt_tokens"] == n and answer["usage"]["completion_tokens"] == 12
    assert decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"') > received
    wait_for(lambda: prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')
             == pulled + 1 and _held(prefill) == 0, what="the prefill engine frees the blocks")
    assert decode.metric("sluice:kv_transfer_fallbacks_total") == 0


def test_prefix_hits_on_either_side_transfer_only_missing_blocks(pd):
    prefill, decode = pd
    salt = f"s-{uuid.uuid4().hex}"
    received = decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"')
    first, _ = two_legs(prefill, decode, LONG, cache_salt=salt)
    n1 = first["usage"]["prompt_tokens"]
    per_block = (decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"')
                 - received) / -(-(n1 - 1) // BS)
    longer = LONG + " And then the list ends."
    received = decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"')
    first, answer = two_legs(prefill, decode, longer, cache_salt=salt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefill-side hit
    hit = answer["usage"]["prompt_tokens_details"]["cached_tokens"]  # decode-side hit
    n2 = answer["usage"]["prompt_tokens"]
    assert hit >= (n1 // BS) * BS - BS and hit % BS == 0
    moved = decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"') - received
    assert moved == (-(-(n2 - 1) // BS) - hit // BS) * per_block
    assert answer["choices"][0]["text"] == plain(decode, longer)


def test_prefiller_header_runs_both_legs_concurrently(pd):
    prefill, decode = pd
    prompts = [f"Story number {i}: once upon a time" for i in range(3)] + [LONG]
    header = {HEADER: f"127.0.0.1:{prefill.port}"}
    pulled = prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')

    def run(prompt):
        r = _post(decode, _body(prompt), headers=header)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with cf.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(run, prompts))
    assert texts == [plain(decode, p) for p in prompts]
    wait_for(lambda: prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')
             == pulled + 4, what="four pulls")
    assert decode.metric("sluice:kv_transfer_prefill_leg_failures_total") == 0
    assert decode.metric("sluice:kv_transfer_fallbacks_total") == 0


def test_prefiller_header_chat_and_stream(pd):
    prefill, decode = pd
    header = {HEADER: f"127.0.0.1:{prefill.port}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    ref = _post(decode, {**chat, "cache_salt": "ref-chat"}, "/v1/chat/completions").json()
    r = _post(decode, chat, "/v1/chat/completions", header)
    assert r.json()["choices"][0]["message"] == ref["choices"][0]["message"]
    with httpx.stream("POST", decode.url + "/v1/completions", headers=header, timeout=60,
                      json=_body("A streamed story", stream=True)) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
    text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines)
    assert text == plain(decode, "A streamed story")
    assert decode.metric("sluice:kv_transfer_prefill_leg_failures_total") == 0


@pytest.mark.parametrize(("params", "extra", "needle"), [
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1],
      "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "r",
      "secret_sauce": 1}, {}, "secret_sauce"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, {}, "both be true"),
    ({"do_remote_prefill": True, "remote_block_ids": [1]}, {}, "remote_engine_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, 2, 3],
      "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "r"}, {},
     "fills 1 blocks"),
    ({"do_remote_decode": True}, {"n": 2}, "n = 1"),
    ({"do_remote_decode": True}, {"stream": True}, "stream: false"),
    ({"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": "1"}, {},
     "remote_block_ids"),
])
def test_bad_params_get_a_clear_400(pd, params, extra, needle):
    _, decode = pd
    r = _post(decode, _body("Hello there", kv_transfer_params=params, **extra))
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_malformed_prefiller_header_is_a_400(pd):
    _, decode = pd
    r = _post(decode, _body("Hello"), headers={HEADER: "no-port-here"})
    assert r.status_code == 400 and HEADER in r.json()["error"]["message"]


def test_unpulled_blocks_are_freed_after_the_hold_timeout(pd):
    """A decode engine that dies before its pull: the prefill engine's hold expires."""
    prefill, _ = pd
    expired = prefill.metric("sluice:kv_transfer_requests_total", 'outcome="expired"')
    prefill_leg(prefill, LONG)
    assert _held(prefill) > 0 and prefill.metric("vllm:kv_cache_usage_perc") > 0
    wait_for(lambda: _held(prefill) == 0, timeout=15, what="the hold expires (3 s)")
    assert prefill.metric("sluice:kv_transfer_requests_total", 'outcome="expired"') == expired + 1
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0


def test_a_killed_prefill_engine_means_a_local_prefill(pd, tiny_chat_model):
    _, decode = pd
    doomed = _start(tiny_chat_model, "kv_producer").wait_ready()
    try:
        first = prefill_leg(doomed, LONG)
    finally:
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
    fallbacks = decode.metric("sluice:kv_transfer_fallbacks_total")
    r = _post(decode, _body(LONG, kv_transfer_params=first["kv_transfer_params"]))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain(decode, LONG)
    assert decode.metric("sluice:kv_transfer_fallbacks_total") == fallbacks + 1
    # the header naming the dead engine: the prefill leg fails, the request completes
    failures = decode.metric("sluice:kv_transfer_prefill_leg_failures_total")
    r = _post(decode, _body("Hello world"), headers={HEADER: f"127.0.0.1:{doomed.port}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain(decode,
                                                                            "Hello world")
    assert decode.metric("sluice:kv_transfer_prefill_leg_failures_total") == failures + 1
    wait_for(lambda: decode.metric("vllm:kv_cache_usage_perc") == 0, what="no leaked blocks")


def test_a_killed_decode_engine_leaks_no_blocks_on_the_prefill_engine(pd, tiny_chat_model):
    """Killed during its decode leg (before, during or after its pull: the hold ends
    either way, by the pull or by the timeout)."""
    prefill, _ = pd
    doomed = _start(tiny_chat_model, "kv_consumer").wait_ready()
    params = prefill_leg(prefill, LONG)["kv_transfer_params"]
    assert _held(prefill) > 0
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, doomed, _body(LONG, 400, kv_transfer_params=params))
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait()
        with pytest.raises(httpx.HTTPError):
            pending.result()
    wait_for(lambda: _held(prefill) == 0, timeout=15, what="the hold ends (pull or 3 s)")
    wait_for(lambda: prefill.metric("vllm:kv_cache_usage_perc") == 0, what="no leaked blocks")
