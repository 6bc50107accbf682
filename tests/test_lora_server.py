"""LoRA adapters through a real `sluice engine` process and the `openai` SDK: a request names
its adapter in `model` and gets PEFT's output; /v1/models lists adapters with their parent;
vLLM's load and unload endpoints work behind the engine key, under traffic, with no request
lost; an unknown adapter is a 404 and a bad adapter file a 400 that names the problem."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import openai
import pytest
from engine_server import EngineProcess
from hf_models import hf_greedy, load_hf
from lora_adapters import make_adapter, peft_greedy

from sluice.tokenizer import Tokenizer

MODEL, KEY = "tiny-chat", "engine-key"
PROMPT = [1, 400, 2000, 31, 9, 77, 1200]
ADMIN = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory):
    """name -> (folder, the text of PEFT's greedy output on PROMPT); None -> the base
    model's."""
    root = tmp_path_factory.mktemp("server-loras")
    out = {}
    for seed, name in enumerate(("sql", "poet")):
        model = make_adapter(lambda: load_hf(tiny_chat_model), root / name, seed=seed, rank=8)
        out[name] = (root / name, peft_greedy(model, PROMPT, 8))
    out[None] = (None, hf_greedy(load_hf(tiny_chat_model), PROMPT, 8))
    tok = Tokenizer.from_path(str(tiny_chat_model))  # the engine's (its text is compared)
    return {name: (folder, tok.decode(ids, skip_special_tokens=True))
            for name, (folder, ids) in out.items()}


@pytest.fixture(scope="module")
def engine(tiny_chat_model, adapters):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512",
                         "--api-key", KEY, "--enable-lora", "--max-loras", "2",
                         "--max-lora-rank", "8", "--lora-modules",
                         f"sql={adapters['sql'][0]}").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key=KEY, max_retries=0)


def complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model and out.usage.completion_tokens == 8
    return out.choices[0].text


def admin(engine, path: str, body: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, headers=headers, timeout=60)


def test_requests_name_their_adapter_and_get_peft_output(client, adapters):
    assert complete(client, "sql") == adapters["sql"][1]
    assert complete(client, MODEL) == adapters[None][1]
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(adapters["sql"][0])
    assert getattr(cards[MODEL], "parent", None) is None


def test_an_unknown_adapter_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        complete(client, "nope")


def test_load_and_unload_under_traffic_lose_no_request(engine, client, adapters):
    assert admin(engine, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": "/x"},
                 headers={}).status_code == 401
    with cf.ThreadPoolExecutor(4) as pool:
        traffic = [pool.submit(complete, client, name) for name in ("sql", MODEL) * 6]
        r = admin(engine, "/v1/load_lora_adapter",
                  {"lora_name": "poet", "lora_path": str(adapters["poet"][0])})
        assert r.status_code == 200, r.text
        poet = [pool.submit(complete, client, "poet") for _ in range(3)]
        assert [f.result() for f in poet] == [adapters["poet"][1]] * 3
        assert admin(engine, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code == 200
        for name, f in zip(("sql", None) * 6, traffic):
            assert f.result() == adapters[name][1]
    with pytest.raises(openai.NotFoundError):
        complete(client, "poet")
    r = admin(engine, "/v1/unload_lora_adapter", {"lora_name": "poet"})
    assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, message", [
    ({"lora_name": "sql", "lora_path": "/x"}, "has already been loaded"),
    ({"lora_name": "bad", "lora_path": "/nowhere"}, "no adapter_config.json in /nowhere"),
    ({"lora_name": MODEL, "lora_path": "/x"}, "is the base model's name"),
    ({"lora_name": "a,b", "lora_path": "/x"}, "invalid LoRA adapter name"),
    ({"lora_name": "x"}, "lora_path"),
])
def test_a_bad_load_is_a_400_that_names_the_problem(engine, client, adapters, body, message):
    r = admin(engine, "/v1/load_lora_adapter", body)
    assert r.status_code == 400 and message in json.dumps(r.json()), r.text
    assert complete(client, "sql") == adapters["sql"][1]  # nobody else harmed


def test_an_adapter_over_the_rank_limit_is_a_400(engine, tiny_chat_model, tmp_path):
    make_adapter(lambda: load_hf(tiny_chat_model), tmp_path, seed=3, rank=16)
    r = admin(engine, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "over --max-lora-rank 8" in r.json()["error"]["message"]


def test_lora_requests_info_shows_the_batch_limit(engine):
    text = httpx.get(engine.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'model_name="tiny-chat"' in line
