"""Tensor parallelism, the pure half: spec.engine.tensorParallelSize parsed and checked, and
what it renders for both engine kinds (the flag, the GPUs, /dev/shm, a CPU pool's requests
and per-rank threads). No cluster, no I/O."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import yaml

from sluice.operator import tensor_parallel as tp
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec, SpecError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "charts/sluice/examples").glob("pool-*.yaml"))
LLAMA_70B = {"numAttentionHeads": 64, "numKeyValueHeads": 8, "intermediateSize": 28672}


def _example(name: str) -> dict:
    body = yaml.safe_load((ROOT / "charts/sluice/examples" / name).read_text())
    body["metadata"]["uid"] = "uid-1"
    return body


def _cpu(n: int, requests: dict | None = None, limits: dict | None = None) -> dict:
    """The default-model CPU pool with N ranks and these resources (none: no cpu given)."""
    body = _example("pool-cpu.yaml")
    body["spec"]["engine"]["tensorParallelSize"] = n
    body["spec"]["resources"] = {"requests": {"memory": "2Gi", **(requests or {})},
                                 "limits": {"memory": "4Gi", **(limits or {})}}
    return body


def _gpu(kind: str, n: int, gpus: int | str = "same") -> dict:
    """pool-vllm-gpu.yaml (Llama-3.1-8B) as `kind` with N ranks and N GPUs (or `gpus`)."""
    body = _example("pool-vllm-gpu.yaml")
    body["spec"]["engine"].update(kind=kind, tensorParallelSize=n)
    body["spec"]["resources"]["limits"]["nvidia.com/gpu"] = n if gpus == "same" else gpus
    return body


def _pod(body: dict) -> dict:
    (deployment,) = [m for m in render_pool(PoolSpec.from_body(body)) if m["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def _flag(args: list[str], name: str) -> str | None:
    """The value of the last `name` among `args` (argparse's), None when absent."""
    values = [args[i + 1] for i, a in enumerate(args) if a == name]
    return values[-1] if values else None


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_one_rank_renders_every_example_as_before(path):
    """tensorParallelSize 1, stated or defaulted, adds nothing: byte-identical children."""
    body = yaml.safe_load(path.read_text())
    body["metadata"]["uid"] = "uid-1"
    n = body["spec"].get("engine", {}).pop("tensorParallelSize", 1)
    if n != 1:
        pytest.skip("an example with tensor parallelism")
    stated = copy.deepcopy(body)
    stated["spec"].setdefault("engine", {})["tensorParallelSize"] = 1
    rendered = render_pool(PoolSpec.from_body(body))
    assert render_pool(PoolSpec.from_body(stated)) == rendered
    for deployment in [m for m in rendered if m["kind"] == "Deployment"]:
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert _flag(args, "--tensor-parallel-size") is None
        assert _flag(args, "--num-threads") is None


@pytest.mark.parametrize("kind,command", [("sluice", ["sluice"]), ("vllm", ["vllm", "serve"])])
def test_both_kinds_get_the_flag_and_a_gpu_per_rank(kind, command):
    container = _pod(_gpu(kind, 2))["containers"][0]
    assert container["command"] == command
    assert _flag(container["args"], "--tensor-parallel-size") == "2"
    assert _flag(container["args"], "--num-threads") is None  # GPUs: the engine's own
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "2"


def test_a_gpu_count_given_as_a_request_only_is_also_the_limit():
    body = _gpu("vllm", 4)
    del body["spec"]["resources"]["limits"]["nvidia.com/gpu"]
    body["spec"]["resources"]["requests"]["nvidia.com/gpu"] = "4"
    resources = _pod(body)["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "4"


def test_the_70b_example_runs_on_eight_gpus_with_8gi_of_shm():
    pod = _pod(_example("pool-tp.yaml"))
    container = pod["containers"][0]
    assert _flag(container["args"], "--tensor-parallel-size") == "8"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


@pytest.mark.parametrize("body,expected", [
    (_gpu("sluice", 2), {"medium": "Memory", "sizeLimit": "2Gi"}),
    (_gpu("vllm", 4), {"medium": "Memory", "sizeLimit": "4Gi"}),
    (_cpu(3, {"cpu": "8"}), {"medium": "Memory", "sizeLimit": "3Gi"}),
    (_gpu("vllm", 1), {"medium": "Memory"}),  # vLLM's, as before: unbounded
    (_gpu("sluice", 1), None),
])
def test_dev_shm_is_in_memory_and_sized_per_rank(body, expected):
    pod = _pod(body)
    volumes = [v["emptyDir"] for v in pod["volumes"] if v["name"] == "dshm"]
    assert volumes == ([expected] if expected else [])
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(mounts) == len(volumes)


@pytest.mark.parametrize("requests,limits,threads,cpu_request", [
    ({"cpu": "8"}, {}, "2", "8"),  # 3 ranks x 2 threads, 1 CPU for the API process
    ({"cpu": 10}, {}, "3", "10"),
    ({"cpu": "7500m"}, {}, "2", "7500m"),  # the whole CPUs it is guaranteed: 7
    ({}, {"cpu": "10"}, "3", "10"),  # Kubernetes requests the limit
    ({"cpu": "4"}, {"cpu": "16"}, "1", "4"),  # the request is what it is guaranteed
    ({}, {}, "1", "4"),  # none given: one thread per rank, and N + 1 CPUs requested
])
def test_a_cpu_pools_ranks_share_its_cpus(requests, limits, threads, cpu_request):
    container = _pod(_cpu(3, requests, limits))["containers"][0]
    assert _flag(container["args"], "--tensor-parallel-size") == "3"
    assert _flag(container["args"], "--num-threads") == threads
    resources = container["resources"]
    assert resources.get("requests", {}).get("cpu", resources["limits"].get("cpu")) == cpu_request
    assert "nvidia.com/gpu" not in resources["requests"]
    assert int(threads) * 3 + 1 <= tp.quantity(cpu_request)


def test_engine_args_come_after_and_win():
    body = _cpu(3, {"cpu": "8"})
    body["spec"]["engine"]["args"] = ["--num-threads", "1"]
    assert _flag(_pod(body)["containers"][0]["args"], "--num-threads") == "1"


def test_a_vllm_cpu_pool_gets_the_flag_only():
    body = _gpu("vllm", 2)
    body["spec"]["resources"] = {"requests": {"memory": "8Gi"}}
    container = _pod(body)["containers"][0]
    assert _flag(container["args"], "--tensor-parallel-size") == "2"
    assert _flag(container["args"], "--num-threads") is None  # vLLM has no such flag
    assert container["resources"] == {"requests": {"memory": "8Gi"}}


def test_the_default_models_sizes_follow_its_shape():
    assert tp.DEFAULT_MODEL_SIZES == (1, 3)  # 9 heads, 3 KV heads, MLP 1536 (not 9: 1536 % 9)
    assert PoolSpec.from_body(_cpu(3, {"cpu": "4"})).engine.tensor_parallel_size == 3


def _with(body: dict, **changes) -> dict:
    """`body` with spec.<dotted path> = value for each change (`__` for the dots)."""
    for path, value in changes.items():
        node = body["spec"]
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return body


REFUSED = [
    (_cpu(2, {"cpu": "8"}), tp.DEFAULT_MODEL),
    (_cpu(65, {"cpu": "80"}), "must be 1 to 64"),
    (_with(_cpu(3, {"cpu": "8"}), engine__lora={}), tp.LORA),
    (_with(_cpu(3, {"cpu": "8"}), loras=[{"name": "a", "source": {"image": {"path": "/a"}}}]),
     tp.LORA),
    (_with(_gpu("sluice", 6), model__shape=LLAMA_70B), tp.SHAPE_HEADS),
    (_with(_gpu("sluice", 8), model__shape={**LLAMA_70B, "intermediateSize": 1004}),
     tp.SHAPE_MLP),
    (_with(_gpu("sluice", 4), model__shape={**LLAMA_70B, "numKeyValueHeads": 6}), tp.SHAPE_KV),
    (_gpu("vllm", 4, gpus=1), tp.GPUS),
    (_gpu("sluice", 2, gpus="4"), tp.GPUS),
    (_cpu(3, {"cpu": "3"}), tp.CPUS),
    (_cpu(3, {"cpu": "3900m"}), tp.CPUS),
    (_cpu(3, {"cpu": "1"}, {"cpu": "16"}), tp.CPUS),
]


@pytest.mark.parametrize("body,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_what_the_crd_refuses_the_operator_refuses_in_the_same_words(body, message):
    with pytest.raises(SpecError) as refused:
        PoolSpec.from_body(copy.deepcopy(body))
    assert message in str(refused.value)


def test_prefill_decode_roles_take_more_than_one_rank_with_their_own_threads():
    """The engines move every KV head whatever their tensor-parallel size; each role's
    ranks get the threads its own CPUs give."""
    body = _cpu(3)
    del body["spec"]["replicas"]
    body["spec"]["model"]["source"] = {"image": {"path": "/m"}}
    body["spec"]["roles"] = {"prefill": {"resources": {"requests": {"cpu": "10"}}},
                             "decode": {"resources": {"requests": {"cpu": "4"}}}}
    threads = {}
    for m in render_pool(PoolSpec.from_body(body)):
        if m["kind"] == "Deployment":
            (engine,) = [c for c in m["spec"]["template"]["spec"]["containers"]
                         if c["name"] == "engine"]
            role = json.loads(_flag(engine["args"], "--kv-transfer-config"))["kv_role"]
            assert _flag(engine["args"], "--tensor-parallel-size") == "3"
            threads[role] = _flag(engine["args"], "--num-threads")
    assert threads == {"kv_producer": "3", "kv_consumer": "1"}


@pytest.mark.parametrize("body", [
    _with(_gpu("vllm", 2), engine__lora={}),  # vLLM serves LoRA under TP
    _with(_gpu("sluice", 8), model__shape=LLAMA_70B),
    _with(_gpu("sluice", 16, gpus=16), model__shape=LLAMA_70B),  # KV heads replicated
    _with(_gpu("sluice", 4), model__shape={"numAttentionHeads": 32, "intermediateSize": 256}),
    _gpu("sluice", 1, gpus=8),  # one rank: any GPU count, as before the field
], ids=["vllm-lora", "70b-8", "70b-16", "mha", "one-rank"])
def test_what_splits_is_accepted(body):
    PoolSpec.from_body(body)


@pytest.mark.parametrize("text,value", [("4", 4), ("500m", 0.5), ("1.5", 1.5), ("2k", 2000),
                                        ("1Ki", 1024), ("1e3", 1000), (8, 8)])
def test_quantities(text, value):
    assert tp.quantity(text) == value
