"""The InferencePool CRD: generated files in sync, examples valid, negative specs rejected
with the intended message, CRD itself valid against the Kubernetes schemas."""

from __future__ import annotations

import copy
import pathlib

import k8s_schema
import pytest
import yaml

from sluice.operator import crd
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "charts" / "sluice" / "examples").glob("pool-*.yaml"))
SCHEMA = k8s_schema.crd_schema(crd.render_crd())


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


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_and_parse(path):
    body = yaml.safe_load(path.read_text())
    defaulted, errors = k8s_schema.validate(SCHEMA, body)
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

NEGATIVE = [
    ("spec.replicas", -1, "spec.replicas"),
    ("spec.model", _DELETE, "'model' is a required property"),
    ("spec.engine.kind", "tgi", "'tgi' is not one of"),
    ("spec.engine.blockSize", 17, "17 is not one of"),
    ("spec.engine.gpuMemoryUtilization", 0, "spec.engine.gpuMemoryUtilization"),
    ("spec.engine.kvCacheMemory", "lots", "does not match"),
    ("spec.roles", {"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
     "set exactly one of spec.replicas"),
    ("spec.replicas", _DELETE, "set exactly one of spec.replicas"),
    ("spec.model.source", {"image": {"path": "/m"}, "pvc": {"claimName": "x"}},
     "exactly one of huggingFace, pvc, image"),
    ("spec.autoscaling", {"enabled": True, "minReplicas": 5, "maxReplicas": 2},
     "minReplicas must be <= autoscaling.maxReplicas"),
    ("spec.autoscaling", {"targetKVCacheUsage": 1.5}, "spec.autoscaling.targetKVCacheUsage"),
    ("metadata.name", "x" * 49, "at most 48 characters"),
]


@pytest.mark.parametrize("path,value,message", NEGATIVE, ids=[n[0] + str(i) for i, n in enumerate(NEGATIVE)])
def test_invalid_specs_are_rejected_with_a_clear_message(path, value, message):
    _, errors = k8s_schema.validate(SCHEMA, _with(path, value))
    assert errors, "expected a rejection"
    assert any(message in e for e in errors), errors


def test_vllm_needs_a_model_source():
    body = _with("spec.engine", {"kind": "vllm"})
    _, errors = k8s_schema.validate(SCHEMA, body)
    assert any("engine kind vllm needs spec.model.source" in e for e in errors)
    body = _with("spec.engine", {"kind": "vllm", "kvCacheMemory": "1GiB"})
    body["spec"]["model"]["source"] = {"image": {"path": "/m"}}
    _, errors = k8s_schema.validate(SCHEMA, body)
    assert any("kvCacheMemory is only for kind sluice" in e for e in errors)


def test_defaults_are_applied_like_the_operator_reads_them():
    defaulted, errors = k8s_schema.validate(SCHEMA, _base())
    assert errors == []
    engine = defaulted["spec"]["engine"]
    assert engine["blockSize"] == 16 and engine["prefixCaching"] is True
    assert defaulted["spec"]["autoscaling"]["targetKVCacheUsage"] == 0.7
    a = PoolSpec.from_body(defaulted)
    b = PoolSpec.from_body(_base())  # the operator applies the same defaults itself
    assert a == b
