"""The operator's adapter sync against a real `sluice engine` process (the contract the
fake engines of test_operator_lora.py stand in for): an image adapter and a Hugging Face
one (from the engine's offline Hub cache) are loaded and counted, requests naming them
are served, and a removed one is unloaded."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import httpx
import pytest
import yaml
from engine_server import EngineProcess
from fake_lora_engine import LoopbackTransport
from hf_models import load_hf
from lora_adapters import hub_cache, make_adapter

from sluice.operator.lora import LoraSyncer
from sluice.operator.spec import PoolSpec

pytestmark = pytest.mark.slow  # an engine process

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = "sk-engine-test"
POD = {"metadata": {"name": "p0"}, "spec": {"containers": [{"name": "engine"}]},
       "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture(scope="module")
def setup(tiny_chat_model, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("operator-lora")
    make_adapter(lambda: load_hf(tiny_chat_model), root / "sql", seed=0, rank=8)
    make_adapter(lambda: load_hf(tiny_chat_model), root / "chat", seed=1, rank=8)
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_CACHE", str(hub_cache(root / "hub", "org/chat",
                                                            root / "chat")))
    pool = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
    base = pool["spec"]["model"]["name"]
    engine = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", base,
                           "--num-kv-blocks", "128", "--api-key", KEY, "--enable-lora",
                           "--max-loras", "2", "--max-lora-rank", "8").wait_ready()
    yield engine, pool, root
    engine.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def sync(url: str, body: dict, loras: list[dict]):
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = "uid-1"
    body["spec"]["engine"]["lora"] = {"maxLoras": 2, "maxLoraRank": 8}
    body["spec"]["loras"] = loras

    async def go():
        async with httpx.AsyncClient(transport=LoopbackTransport(url)) as http:
            return await LoraSyncer(http, KEY).sync(PoolSpec.from_body(body), [POD])
    return asyncio.run(go())


def served(engine) -> dict[str, str]:
    data = httpx.get(engine.url + "/v1/models", timeout=10,
                     headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    return {m["id"]: m["root"] for m in data if m.get("parent")}


def test_the_operator_loads_counts_and_unloads_adapters_on_a_real_engine(setup):
    engine, pool, root = setup
    loras = [{"name": "sql", "source": {"image": {"path": str(root / "sql")}}},
             {"name": "chat", "source": {"huggingFace": {"repo": "org/chat"}}}]
    report = sync(engine.url, pool, loras)
    assert report.problems == [], report.problems
    assert report.status == [{"name": "sql", "readyReplicas": 1},
                             {"name": "chat", "readyReplicas": 1}]
    assert served(engine) == {"sql": str(root / "sql"), "chat": "org/chat"}
    for model in ("sql", "chat"):
        r = httpx.post(engine.url + "/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": model, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
    again = sync(engine.url, pool, loras[:1])
    assert again.unloaded == {"chat": 1} and served(engine) == {"sql": str(root / "sql")}
