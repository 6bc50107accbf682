"""A LoRA adapter's request disaggregated between two real `sluice engine` processes: the
prefill leg runs with the adapter, its kv_transfer_params name it, and the decode leg
equals the plain run with that adapter; params of another adapter are a 400."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from engine_server import EngineProcess
from hf_models import load_hf
from lora_adapters import make_adapter

pytestmark = pytest.mark.slow  # engine processes

MODEL = "tiny-chat"
PROMPT = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(20))
LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
       "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def pd(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-lora")
    make_adapter(lambda: load_hf(tiny_chat_model), folder, seed=5, rank=8)
    kv = json.dumps({"kv_connector": "SluiceConnector", "kv_role": "kv_both", "kv_port": 0})
    engines = [EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                             "--dtype", "float32", "--num-kv-blocks", "256", "--block-size",
                             "16", "--max-model-len", "1024", "--kv-transfer-config", kv,
                             "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
                             f"ad={folder}") for _ in range(2)]
    try:
        yield tuple(e.wait_ready() for e in engines)
    finally:
        for e in engines:
            e.stop()


def post(engine, model: str, max_tokens: int, **kw) -> httpx.Response:
    return httpx.post(engine.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **kw})


def test_an_adapters_disaggregated_request_equals_its_plain_run(pd):
    prefill, decode = pd
    plain = post(decode, "ad", 10, cache_salt=uuid.uuid4().hex).json()["choices"][0]["text"]
    assert plain != post(decode, MODEL, 10).json()["choices"][0]["text"]
    first = post(prefill, "ad", 1, kv_transfer_params=LEG).json()
    params = first["kv_transfer_params"]
    assert params["lora_name"] == "ad" and params["remote_block_ids"]
    r = post(decode, "ad", 10, kv_transfer_params=params)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain
    assert decode.metric("sluice:kv_transfer_bytes_total", "received") > 0


def test_params_of_another_adapter_are_a_400(pd):
    prefill, decode = pd
    params = post(prefill, MODEL, 1, kv_transfer_params=LEG).json()["kv_transfer_params"]
    r = post(decode, "ad", 10, kv_transfer_params=params)
    assert r.status_code == 400 and "another adapter" in r.json()["error"]["message"]
