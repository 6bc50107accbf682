"""Disaggregated prefill/decode with a tensor-parallel engine on either side: the wire
carries every KV head, so a two-rank engine's blocks (each rank holding half the heads)
reach a one-rank engine and back, and the decode leg's greedy tokens equal one engine's,
with the caches in float32 or fp8. Real `sluice engine` processes over loopback, float32."""

from __future__ import annotations

import json

import pytest
from engine_server import EngineProcess
from polling import wait_for
from test_kv_transfer_engines import BS, LONG, MODEL, plain, two_legs

pytestmark = pytest.mark.slow  # engine processes


def _start(model, tp: int, cache_dtype: str) -> EngineProcess:
    kv = json.dumps({"kv_connector": "SluiceConnector", "kv_role": "kv_both", "kv_port": 0})
    return EngineProcess("--model", str(model), "--served-model-name", MODEL,
                         "--dtype", "float32", "--num-kv-blocks", "256", "--block-size",
                         str(BS), "--max-model-len", "1024", "--max-num-batched-tokens", "64",
                         "--num-threads", "1", "--tensor-parallel-size", str(tp),
                         "--kv-cache-dtype", cache_dtype, "--kv-transfer-config", kv)


@pytest.fixture(scope="module", params=["auto", "fp8"])
def engines(tiny_chat_model, request):
    started = [_start(tiny_chat_model, 2, request.param),
               _start(tiny_chat_model, 1, request.param)]
    try:
        yield tuple(e.wait_ready() for e in started)
    finally:
        for e in started:
            e.stop()


@pytest.mark.parametrize("direction", ["two ranks prefill", "two ranks decode"])
@pytest.mark.parametrize("prompt", ["The quick brown fox", LONG])
def test_blocks_move_between_tensor_parallel_sizes(engines, direction, prompt):
    tp2, tp1 = engines
    prefill, decode = (tp2, tp1) if direction == "two ranks prefill" else (tp1, tp2)
    received = decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"')
    pulled = prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')
    _, answer = two_legs(prefill, decode, prompt)
    assert answer["choices"][0]["text"] == plain(tp1, prompt)
    assert decode.metric("sluice:kv_transfer_bytes_total", 'direction="received"') > received
    assert decode.metric("sluice:kv_transfer_fallbacks_total") == 0
    wait_for(lambda: prefill.metric("sluice:kv_transfer_requests_total", 'outcome="pulled"')
             == pulled + 1, what="the prefill engine's hold is pulled")
