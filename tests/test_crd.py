"""The InferencePool CRD on a real kube-apiserver: generated files in sync, the CRD accepted,
examples created with the defaults the operator assumes, every CEL rule exercised with a
passing and a failing object, negative specs refused with the intended message."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from sluice.operator import crd
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "charts" / "sluice" / "examples").glob("pool-*.yaml"))


def test_generated_crd_files_are_in_sync():
    for path in crd.CRD_PATHS:
        assert path.read_text() == crd.crd_yaml(), f"{path}: run python -m sluice.operator.crd --write"


def test_crd_names_and_subresources():
    c = crd.render_crd()
    assert c["metadata"]["name"] == "inferencepools.sluice.dev"
    assert c["spec"]["names"]["shortNames"] == ["spool"]
    version = c["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    columns = {col["name"]: col["jsonPath"] for col in version["additionalPrinterColumns"]}
    assert list(columns)[:6] == ["Model", "Replicas", "Ready", "Prefill", "Decode", "KV-Usage"]
    assert list(columns)[-1] == "Age"
    # both roles' replicas of a prefill/decode pool (the status the operator writes)
    assert (columns["Prefill"], columns["Decode"]) == (".status.roles.prefill.replicas",
                                                       ".status.roles.decode.replicas")


@pytest.mark.parametrize("version", ["1.30", "1.37"])
def test_crd_validates_against_kubernetes_schema(version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(crd.render_crd(), version, strict=True)


def test_the_api_server_establishes_the_crd(kube_plane):
    status = kube_plane.request("GET", "/apis/apiextensions.k8s.io/v1/"
                                f"customresourcedefinitions/{crd.CRD_NAME}")["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema") is None, status


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_and_parse(kube_plane, path):
    body = yaml.safe_load(path.read_text())
    defaulted, errors = kube_plane.dry_run_create(body)
    assert errors == []
    pool = PoolSpec.from_body(defaulted)
    assert pool.model_name == body["spec"]["model"]["name"]


def _base() -> dict:
    return yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())


def _with(path: str, value) -> dict:
    body = copy.deepcopy(_base())
    node = body
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return body


_DELETE = object()


def _lora(name: str, path: str = "/adapters/sql") -> dict:
    return {"name": name, "source": {"image": {"path": path}}}

NEGATIVE = [
    ("spec.replicas", -1, "spec.replicas in body should be greater than or equal to 0"),
    # quantized weights and KV cache: what the sluice engine takes
    ("spec.engine.quantization", "bitsandbytes",
     "engine.quantization: the sluice engine takes gguf, fp8, gptq or awq"),
    ("spec.engine.lora", {}, "needs tensorParallelSize 1 and no engine.lora"),
    ("spec.engine.kvCacheDtype", "fp8_e5m2", "engine.kvCacheDtype fp8_e5m2 needs engine kind"),
    ("spec.model", _DELETE, "spec.model: Required value"),
    ("spec.engine.kind", "tgi", 'Unsupported value: "tgi"'),
    ("spec.engine.blockSize", 17, "Unsupported value: 17"),
    ("spec.engine.gpuMemoryUtilization", 0, "should be greater than 0"),
    ("spec.engine.kvCacheMemory", "lots", "kvCacheMemory in body should match"),
    ("spec.roles", {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
     "set exactly one of spec.replicas"),
    ("spec.replicas", _DELETE, "set exactly one of spec.replicas"),
    ("spec.model.source", {"image": {"path": "/m"}, "pvc": {"claimName": "x"}},
     "exactly one of huggingFace, pvc, image"),
    ("spec.autoscaling", {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
     "minReplicas must be <= autoscaling.maxReplicas"),
    ("spec.autoscaling", {"targetKVCacheUsage": 1.5}, "should be less than or equal to 1"),
    ("metadata.name", "x" * 49, "at most 48 characters"),
    ("spec.engine", {"kind": "vllm"}, "engine kind vllm needs spec.model.source"),
    ("spec.engine", {"kind": "vllm", "kvCacheMemory": "1GiB"},
     "engine.kvCacheMemory is only for kind sluice"),
    ("spec.engine", {"kind": "vllm", "speculative": {"method": "early_exit",
                                                     "numSpeculativeTokens": 2, "numLayers": 4}},
     "engine.speculative early_exit is only for kind sluice"),
    ("spec.engine.speculative", {"method": "draft_model", "numSpeculativeTokens": 2},
     "speculative.model is required for draft_model"),
    ("spec.engine.speculative", {"method": "early_exit", "numSpeculativeTokens": 2},
     "speculative.numLayers is required for early_exit"),
    ("spec.rollout", {"maxSurge": 0, "maxUnavailable": "0%"}, "cannot both be 0"),
    ("spec.podDisruptionBudget", {"maxUnavailable": 1, "minAvailable": 1},
     "set maxUnavailable or minAvailable, not both"),
    ("spec.autoscaling", {"enabled": True}, "a prefill/decode pool autoscales per role"),
    ("spec.engine", {"kind": "vllm"}, "prefill/decode roles need engine kind sluice"),
    # LoRA: the engines' limits, and the adapters (names are the list's map key)
    ("spec.engine.lora", {"maxLoras": 4, "maxCpuLoras": 2},
     "engine.lora.maxCpuLoras must be >= engine.lora.maxLoras"),
    ("spec.engine.lora", {"maxLoraRank": 24}, "Unsupported value: 24"),
    ("spec.engine.lora", {"maxLoras": 0}, "maxLoras in body should be greater than or equal to 1"),
    ("spec.loras", [_lora("sql"), _lora("sql", "/other")],
     'spec.loras[1]: Duplicate value: {"name":"sql"}'),
    ("spec.loras", [_lora("smollm2-135m-instruct")],
     "a LoRA adapter cannot take the model's served name"),
    ("spec.loras", [_lora("sql lora")], "spec.loras[0].name in body should match"),
    ("spec.loras", [_lora("sql-")], "spec.loras[0].name in body should match"),
    ("spec.loras", [{"name": "sql", "source": {"image": {"path": "/a"}, "pvc": {"claimName": "c"}}}],
     "a LoRA adapter's source must set exactly one of huggingFace, pvc, image"),
    ("spec.loras", [{"name": "sql"}], "spec.loras[0].source: Required value"),
    ("spec.loras", [_lora(f"a{i}") for i in range(65)], "must have at most 64 items"),
    # tensor parallelism: what the sluice engine refuses with it, and what it must divide
    ("spec.engine.tensorParallelSize", 65, "should be less than or equal to 64"),
    ("spec.engine.tensorParallelSize", 2, "must be one of 1, 3 for the built-in default model"),
    ("spec.engine.lora", {}, "tensorParallelSize > 1 cannot be combined with LoRA"),
    ("spec.model.shape", {"numAttentionHeads": 8, "intermediateSize": 1536},
     "must divide spec.model.shape.numAttentionHeads"),
    ("spec.model.shape", {"numAttentionHeads": 9, "intermediateSize": 1000},
     "must divide spec.model.shape.intermediateSize"),
    ("spec.model.shape", {"numAttentionHeads": 9, "numKeyValueHeads": 2,
                          "intermediateSize": 1536}, "or be a multiple of it"),
    ("spec.resources", {"limits": {"nvidia.com/gpu": 1}}, "nvidia.com/gpu must equal"),
    ("spec.engine.tensorParallelSize", 3, "cpu must be at least"),
]

# What each failing case above needs besides its own change, so that only its rule fails.
_CONTEXT = {
    "needs tensorParallelSize 1 and no engine.lora": "gguf",
    "engine.kvCacheMemory is only for kind sluice": {"source": {"image": {"path": "/m"}}},
    "engine.speculative early_exit is only for kind sluice": {"source": {"image": {"path": "/m"}}},
    "a prefill/decode pool autoscales per role": "roles",
    "prefill/decode roles need engine kind sluice": "roles",
    "must be one of 1, 3 for the built-in default model": "cpus",
    "tensorParallelSize > 1 cannot be combined with LoRA": "tp",
    "must divide spec.model.shape.numAttentionHeads": "tp",
    "must divide spec.model.shape.intermediateSize": "tp",
    "or be a multiple of it": "tp",
    "nvidia.com/gpu must equal": "tp",
}


def _negative(path, value, message) -> dict:
    body = _with(path, value)
    contexts = _CONTEXT.get(message)
    for context in contexts if isinstance(contexts, tuple) else (contexts,):
        if context == "roles":
            del body["spec"]["replicas"]
            body["spec"]["roles"] = {"prefill": {}, "decode": {}}
            body["spec"]["model"]["source"] = {"image": {"path": "/m"}}
        elif context == "gguf":
            body["spec"]["engine"]["quantization"] = "gguf"
        elif context in ("cpus", "tp"):  # a CPU pool with the CPUs 3 ranks need
            body["spec"].setdefault("resources", {}).setdefault("requests", {})["cpu"] = "8"
            if context == "tp":
                body["spec"]["engine"].setdefault("tensorParallelSize", 3)
        elif context:
            body["spec"]["model"].update(context)
    return body


def _cel_rules(schema: dict) -> list[dict]:
    rules = list(schema.get("x-kubernetes-validations") or ())
    for sub in (schema.get("properties") or {}).values():
        rules += _cel_rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            rules += _cel_rules(schema[key])
    return rules


def test_every_cel_rule_has_a_failing_case():
    schema = crd.render_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    messages = {r["message"] for r in _cel_rules(schema)}
    covered = {m for m in messages if any(expected in m for _, _, expected in NEGATIVE)}
    assert messages - covered == set()


@pytest.mark.parametrize("path,value,message", NEGATIVE, ids=[n[0] + str(i) for i, n in enumerate(NEGATIVE)])
def test_invalid_specs_are_rejected_with_a_clear_message(kube_plane, path, value, message):
    _, errors = kube_plane.dry_run_create(_negative(path, value, message))
    assert errors, "expected a rejection"
    assert any(message in e for e in errors), errors


def test_each_failing_case_fails_only_by_its_change(kube_plane):
    """The passing half of every rule: the same bodies without the change are accepted."""
    for path, _, message in NEGATIVE:
        body = _negative(path, _base_value(path), message)
        assert kube_plane.dry_run_create(body)[1] == [], (path, message)


def _base_value(path: str):
    node = _base()
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return _DELETE
        node = node[key]
    return node


def test_defaults_are_applied_like_the_operator_reads_them(kube_plane):
    defaulted, errors = kube_plane.dry_run_create(_base())
    assert errors == []
    engine = defaulted["spec"]["engine"]
    assert engine["blockSize"] == 16 and engine["prefixCaching"] is True
    assert defaulted["spec"]["autoscaling"]["targetKVCacheUsage"] == 0.7
    a = PoolSpec.from_body(defaulted)
    # the operator applies the same defaults itself (the server's uid and generation aside)
    b = PoolSpec.from_body({**_base(), "metadata": defaulted["metadata"]})
    assert a == b
