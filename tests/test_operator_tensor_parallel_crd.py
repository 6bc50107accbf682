"""Tensor parallelism on a real kube-apiserver: the CRD's CEL rules refuse what the sluice
engine would refuse at start (LoRA, a size that does not split the
default model or a stated shape, a GPU count or CPU request that does not fit the ranks)
with messages that name the fields, accept what it runs, and agree with the operator's own
checks (`PoolSpec.from_body`) on every pool of a grid."""

from __future__ import annotations

import copy
import itertools
import pathlib

import pytest
import yaml

from sluice.operator import tensor_parallel as tp
from sluice.operator.spec import PoolSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[1]
LLAMA_70B = {"numAttentionHeads": 64, "numKeyValueHeads": 8, "intermediateSize": 28672}


def _example(name: str) -> dict:
    return yaml.safe_load((ROOT / "charts/sluice/examples" / name).read_text())


def _cpu(n: int, cpu: str | int | None = "8") -> dict:
    """The default-model CPU pool (sluice engine) with N ranks and this cpu request."""
    body = _example("pool-cpu.yaml")
    body["spec"]["engine"]["tensorParallelSize"] = n
    if cpu is None:
        del body["spec"]["resources"]["requests"]["cpu"]
    else:
        body["spec"]["resources"]["requests"]["cpu"] = cpu
    return body


def _gpu(kind: str, n: int, gpus: int | str | None = None, shape: dict | None = None) -> dict:
    """The 70B example as `kind`, with N ranks and `gpus` GPUs (default N)."""
    body = _example("pool-tp.yaml")
    body["spec"]["engine"].update(kind=kind, tensorParallelSize=n)
    body["spec"]["resources"]["limits"]["nvidia.com/gpu"] = n if gpus is None else gpus
    if shape is not None:
        body["spec"]["model"]["shape"] = shape
    return body


def _refused(plane, body: dict, message: str) -> None:
    _, errors = plane.dry_run_create(body)
    assert any(message in e for e in errors), errors


def _accepted(plane, body: dict) -> PoolSpec:
    defaulted, errors = plane.dry_run_create(body)
    assert errors == []
    return PoolSpec.from_body(defaulted)


def test_the_default_model_runs_on_1_or_3_ranks(kube_plane):
    _refused(kube_plane, _cpu(2), tp.DEFAULT_MODEL)
    _refused(kube_plane, _cpu(9, "16"), tp.DEFAULT_MODEL)  # 9 heads, but an MLP of 1536
    assert _accepted(kube_plane, _cpu(3)).engine.tensor_parallel_size == 3
    body = _example("pool-cpu.yaml")
    defaulted, errors = kube_plane.dry_run_create(body)
    assert errors == [] and defaulted["spec"]["engine"]["tensorParallelSize"] == 1
    _refused(kube_plane, _cpu(65), "should be less than or equal to 64")
    _refused(kube_plane, _cpu(0), "should be greater than or equal to 1")


def test_lora_and_more_than_one_rank_are_refused_on_the_sluice_engine(kube_plane):
    body = _cpu(3)
    body["spec"]["engine"]["lora"] = {}
    _refused(kube_plane, body, "spec.engine.tensorParallelSize > 1 cannot be combined with "
                               "LoRA (spec.engine.lora or spec.loras)")
    body = _cpu(3)
    body["spec"]["loras"] = [{"name": "sql", "source": {"image": {"path": "/a"}}}]
    _refused(kube_plane, body, tp.LORA)
    body["spec"]["engine"]["tensorParallelSize"] = 1
    _accepted(kube_plane, body)
    body = _gpu("vllm", 8)  # vLLM serves adapters under tensor parallelism
    body["spec"]["engine"]["lora"] = {"maxLoras": 2}
    assert _accepted(kube_plane, body).lora is not None


def test_prefill_decode_roles_with_more_than_one_rank_are_accepted(kube_plane):
    body = _cpu(3)
    del body["spec"]["replicas"]
    body["spec"]["roles"] = {"prefill": {}, "decode": {}}
    assert _accepted(kube_plane, body).engine.tensor_parallel_size == 3


def test_early_exit_drafts_take_more_than_one_rank(kube_plane):
    body = _cpu(3)
    body["spec"]["engine"]["speculative"] = {"method": "early_exit", "numSpeculativeTokens": 2,
                                             "numLayers": 4}
    assert _accepted(kube_plane, body).engine.tensor_parallel_size == 3


def test_a_stated_shape_decides_the_sizes(kube_plane):
    assert _accepted(kube_plane, _example("pool-tp.yaml")).model_shape is not None
    _refused(kube_plane, _gpu("vllm", 6), tp.SHAPE_HEADS)  # 64 heads
    _refused(kube_plane, _gpu("vllm", 8, shape={**LLAMA_70B, "intermediateSize": 1004}),
             tp.SHAPE_MLP)
    _refused(kube_plane, _gpu("vllm", 4, shape={**LLAMA_70B, "numKeyValueHeads": 6}),
             tp.SHAPE_KV)
    _accepted(kube_plane, _gpu("vllm", 16))  # 8 KV heads, each on two ranks
    _accepted(kube_plane, _gpu("sluice", 4, shape={"numAttentionHeads": 32,
                                                   "intermediateSize": 256}))
    _refused(kube_plane, _gpu("vllm", 2, shape={"numAttentionHeads": 8}),
             "spec.model.shape.intermediateSize: Required value")


def test_a_gpu_pool_has_one_gpu_per_rank(kube_plane):
    _refused(kube_plane, _gpu("vllm", 8, gpus=4),
             "spec.resources nvidia.com/gpu must equal spec.engine.tensorParallelSize")
    _refused(kube_plane, _gpu("sluice", 2, gpus="1"), tp.GPUS)
    _accepted(kube_plane, _gpu("vllm", 8, gpus="8"))
    body = _gpu("vllm", 8)
    body["spec"]["resources"]["requests"]["nvidia.com/gpu"] = 4
    _refused(kube_plane, body, tp.GPUS)
    _accepted(kube_plane, _gpu("vllm", 1, gpus=8))  # one rank: as before the field


@pytest.mark.parametrize("cpu,ok", [("3", False), (3, False), ("3900m", False), ("4", True),
                                    ("4000m", True), (8, True), (None, True)])
def test_a_cpu_pool_has_a_cpu_per_rank_and_one_for_the_api(kube_plane, cpu, ok):
    body = _cpu(3, cpu)
    if ok:
        _accepted(kube_plane, body)
    else:
        _refused(kube_plane, body, "spec.resources cpu must be at least "
                                   "spec.engine.tensorParallelSize + 1")


def test_a_cpu_limit_is_checked_like_a_request(kube_plane):
    body = _cpu(3, None)
    body["spec"]["resources"]["limits"]["cpu"] = "2"
    _refused(kube_plane, body, tp.CPUS)
    body["spec"]["resources"]["limits"]["cpu"] = "4"
    _accepted(kube_plane, body)


def _grid() -> list[dict]:
    out = []
    for n, kind, resources, extra in itertools.product(
            (1, 2, 3, 4, 8),
            ("sluice", "vllm"),
            ({"limits": {"nvidia.com/gpu": 4}}, {"requests": {"cpu": "5"}}, {}),
            ({}, {"lora": {}}, {"shape": LLAMA_70B}, {"source": None})):
        body = _gpu(kind, n)
        body["spec"]["resources"] = copy.deepcopy(resources)
        if "lora" in extra:
            body["spec"]["engine"]["lora"] = {}
        if "shape" in extra:
            body["spec"]["model"]["shape"] = extra["shape"]
        if "source" in extra:
            del body["spec"]["model"]["source"]
        out.append(body)
    return out


def test_the_api_server_and_the_operator_agree(kube_plane):
    """Every pool of the grid is refused by both, or by neither (a pool stored before a rule
    is checked by the operator alone: it must say what the API server would)."""
    disagreements = []
    for body in _grid():
        _, errors = kube_plane.dry_run_create(body)
        try:
            PoolSpec.from_body(copy.deepcopy(body))
            refused = None
        except SpecError as e:
            refused = str(e)
        if bool(errors) != (refused is not None) or (
                refused and not any(refused in e for e in errors)):
            disagreements.append((body["spec"], errors, refused))
    assert disagreements == []
