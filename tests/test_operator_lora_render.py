"""LoRA, the pure half: spec.loras and spec.engine.lora parsed and checked, the engines'
flags and env for both kinds, a pod template that an adapter list change leaves as it is,
and the per-engine plan of loads and unloads. No cluster, no I/O."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from sluice.operator import lora
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[1]
LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras")


def _example(name: str) -> dict:
    body = yaml.safe_load((ROOT / "charts/sluice/examples" / name).read_text())
    body["metadata"]["uid"] = "uid-1"
    return body


def _cpu(loras: list[dict] | None = None, engine_lora: dict | None = None) -> dict:
    body = _example("pool-cpu.yaml")
    if loras is not None:
        body["spec"]["loras"] = loras
    if engine_lora is not None:
        body["spec"]["engine"]["lora"] = engine_lora
    return body


def _image(name: str, path: str = "/adapters/a") -> dict:
    return {"name": name, "source": {"image": {"path": path}}}


def _pvc(name: str, claim: str, path: str = "") -> dict:
    return {"name": name, "source": {"pvc": {"claimName": claim, "path": path}}}


def _hf(name: str, repo: str = "org/adapter") -> dict:
    return {"name": name, "source": {"huggingFace": {"repo": repo}}}


def _deployment(body: dict) -> dict:
    return next(m for m in render_pool(PoolSpec.from_body(body)) if m["kind"] == "Deployment")


def _container(body: dict) -> dict:
    return _deployment(body)["spec"]["template"]["spec"]["containers"][0]


def _flags(args: list[str]) -> dict[str, str | None]:
    """The LoRA flags among `args`, each with its value (None: a switch)."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(args):
        if a in LORA_FLAGS:
            out[a] = None if a == "--enable-lora" else args[i + 1]
    return out


def test_sluice_engines_get_loras_flags_but_never_the_adapters():
    body = _cpu([_image("sql"), _hf("chat")], {"maxLoras": 2, "maxLoraRank": 64,
                                                "maxCpuLoras": 8})
    container = _container(body)
    assert _flags(container["args"]) == {"--enable-lora": None, "--max-loras": "2",
                                         "--max-lora-rank": "64", "--max-cpu-loras": "8"}
    assert "--lora-modules" not in container["args"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in {e["name"] for e in container["env"]}


def test_vllm_engines_get_the_same_flags_and_the_runtime_loading_switch():
    body = _example("pool-lora.yaml")
    container = _container(body)
    assert container["command"] == ["vllm", "serve"]
    assert _flags(container["args"]) == {"--enable-lora": None, "--max-loras": "2",
                                         "--max-lora-rank": "16", "--max-cpu-loras": "4"}
    assert "--lora-modules" not in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == {
        "name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}
    # a value of the user's own stays the only entry (env is a list keyed by name)
    body["spec"]["engine"]["env"] = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
                                      "value": "true"}]
    names = [e["name"] for e in _container(body)["env"]]
    assert names.count("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == 1


def test_without_loras_engines_run_without_lora():
    for body in (_cpu(), _example("pool-vllm-gpu.yaml")):
        container = _container(body)
        assert _flags(container["args"]) == {}
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in {e["name"] for e in container["env"]}


def test_adapters_alone_turn_lora_on_with_the_defaults_and_engine_lora_alone_too():
    assert _flags(_container(_cpu([_image("sql")]))["args"]) == {
        "--enable-lora": None, "--max-loras": "1", "--max-lora-rank": "16"}
    assert _flags(_container(_cpu([], {}))["args"]) == {
        "--enable-lora": None, "--max-loras": "1", "--max-lora-rank": "16"}


def test_the_pod_template_ignores_the_adapter_list():
    """Adding, removing, renaming or repointing Hub, image and pvc adapters (on a claim the
    pods mount already) leaves the Deployment, spec hash included, as it is: no rollout."""
    lists = [
        [],
        [_image("sql")],
        [_image("sql", "/adapters/other"), _hf("chat")],
        [_hf("chat", "org/other"), _pvc("math", "loras", "math"), _pvc("b", "loras", "b")],
        [_pvc("math", "loras", "v2")],
    ]
    with_claim = [dict(_pvc("keep", "loras"))]
    rendered = [_deployment(_cpu(with_claim + adapters, {})) for adapters in lists]
    assert all(d == rendered[0] for d in rendered[1:])
    # the model's own claim is mounted already: its adapters need no volume of their own
    body = _example("pool-vllm-gpu.yaml")
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "llama"}}
    body["spec"]["engine"]["lora"] = {}
    before = _deployment(body)
    body["spec"]["loras"] = [_pvc("sql", "models", "adapters/sql")]
    assert _deployment(body) == before


def test_an_adapter_on_a_new_claim_mounts_it_read_only():
    before = _deployment(_cpu([], {}))
    after = _deployment(_cpu([_pvc("sql", "team-loras", "sql")], {}))
    assert after != before  # Kubernetes adds no volume to a running pod: a rollout
    pod = after["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": "team-loras", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/loras/team-loras", "readOnly": True}
    # where the operator then loads it from, read from the pod as it runs
    adapter = PoolSpec.from_body(_cpu([_pvc("sql", "team-loras", "sql")], {})).loras[0]
    assert lora.adapter_path(adapter, {"spec": pod}) == "/loras/team-loras/sql"
    assert lora.adapter_path(adapter, {"spec": before["spec"]["template"]["spec"]}) is None


@pytest.mark.parametrize("loras,engine_lora,message", [
    ([_image("a"), _image("a")], None, "listed twice"),
    ([_image("smollm2-135m-instruct")], None, "taken by the model"),
    ([{"name": "a", "source": {"huggingFace": {"repo": "o/a", "revision": "v1"}}}], None,
     "takes a repo only"),
    ([{"name": "a", "source": {}}], None, "a source is required"),
    ([{"name": "a", "source": {"image": {"path": "/a"}, "pvc": {"claimName": "c"}}}], None,
     "spec.loras a: source must set exactly one"),
    ([_image(f"a{i}") for i in range(65)], None, "at most 64 adapters"),
    ([], {"maxLoraRank": 24}, "maxLoraRank must be one of"),
    ([], {"maxLoras": 0}, "maxLoras must be at least 1"),
    ([], {"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras must be >= engine.lora.maxLoras"),
])
def test_specs_the_api_server_did_not_check_are_refused_in_words(loras, engine_lora, message):
    with pytest.raises(SpecError, match=message):
        PoolSpec.from_body(_cpu(copy.deepcopy(loras), engine_lora))


def test_the_example_parses_to_typed_adapters():
    pool = PoolSpec.from_body(_example("pool-lora.yaml"))
    assert [a.name for a in pool.loras] == ["sql-lora", "support-lora"]
    assert pool.lora is not None and pool.lora.max_cpu_loras == 4


def test_listed_adapters_are_the_models_with_a_parent():
    models = {"object": "list", "data": [
        {"id": "base", "root": "/m", "parent": None},
        {"id": "sql", "root": "/adapters/sql", "parent": "base"},
        {"id": "chat", "parent": "base"}]}
    assert lora.listed_adapters(models) == {"sql": "/adapters/sql", "chat": None}
    assert lora.listed_adapters({"data": None}) == {} == lora.listed_adapters([])


def test_plan_loads_the_missing_unloads_the_unlisted_and_reloads_the_repointed():
    desired = {"sql": "/a/sql", "chat": "org/chat", "math": None, "new": "/a/new"}
    listed = {"sql": "/a/sql-v1", "chat": "org/chat", "math": "/old", "stray": "/x"}
    # math: this engine cannot reach its files (not mounted): left as it is
    assert lora.plan(desired, listed) == (["sql", "stray"], ["new", "sql"])
    assert lora.plan({}, {}) == ([], [])


def test_a_hub_adapter_may_be_reported_by_its_download_folder():
    cached = "/model-cache/hf/hub/models--org--chat/snapshots/0123abc"
    assert lora.same_files(cached, "org/chat")
    assert not lora.same_files(cached, "org/other")
    assert lora.same_files(None, "/a") and not lora.same_files("/b", "/a")
