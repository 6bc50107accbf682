"""Tensor parallelism in a pool (`spec.engine.tensorParallelSize` N): one engine split over
N ranks, one process each, in one pod.

The rules, stated once: the CRD's CEL rules (`crd_tp`) carry these messages, and
`check` applies them again for pools the API server did not validate. What N > 1 adds to
the engine pod, besides `--tensor-parallel-size N` (`engine_args`):

- a GPU pool (its resources name `nvidia.com/gpu`, which must then be N): N GPUs, in the
  requests and the limits, one per rank (the engines use GPUs 0 .. N-1);
- a CPU pool of the sluice engine: N core groups of `--num-threads T` each, and one CPU
  left to the API process (`sluice.cpus.engine_threads`, the engine's own default): T from
  the CPUs the pod is guaranteed, its cpu request (else its limit, which Kubernetes then
  requests), which must be at least N + 1; with neither, a request of N + 1 CPUs and T = 1;
- `/dev/shm` in memory for NCCL and the ranks' shared tensors, SHM_PER_RANK_GI GiB per rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sluice.cpus import engine_threads
from sluice.default_model import DEFAULT_MODEL_SHAPE, DEFAULT_SERVED_MODEL_NAME
from sluice.model_shape import ModelShape
from sluice.operator.sources import SpecError

if TYPE_CHECKING:
    from sluice.operator.spec import PoolSpec, Resources

MAX_SIZE = 64  # ranks in one pod: a node's GPUs (8 on an HGX board) or its core groups
GPU = "nvidia.com/gpu"
# NCCL asks containers for 1 GiB of /dev/shm (Docker's default, 64 MiB, breaks its shm
# transport), and vLLM's Kubernetes example gives a TP engine 2 GiB: 1 GiB per rank covers
# both. A memory-backed emptyDir counts against the pod's memory only as it is used.
SHM_PER_RANK_GI = 1
DEFAULT_MODEL_SIZES = DEFAULT_MODEL_SHAPE.sizes(MAX_SIZE)

LORA = ("spec.engine.tensorParallelSize > 1 cannot be combined with LoRA (spec.engine.lora "
        "or spec.loras) on engine kind sluice: the sluice engine refuses --enable-lora with "
        "--tensor-parallel-size > 1")
DEFAULT_MODEL = (
    f"spec.engine.tensorParallelSize must be one of {', '.join(map(str, DEFAULT_MODEL_SIZES))} "
    f"for the built-in default model (no spec.model.source): {DEFAULT_SERVED_MODEL_NAME} has "
    f"{DEFAULT_MODEL_SHAPE.num_attention_heads} attention heads, "
    f"{DEFAULT_MODEL_SHAPE.num_key_value_heads} key/value heads and an MLP intermediate size "
    f"of {DEFAULT_MODEL_SHAPE.intermediate_size}")
SHAPE_HEADS = "spec.engine.tensorParallelSize must divide spec.model.shape.numAttentionHeads"
SHAPE_MLP = "spec.engine.tensorParallelSize must divide spec.model.shape.intermediateSize"
SHAPE_KV = ("spec.engine.tensorParallelSize must divide spec.model.shape.numKeyValueHeads, "
            "or be a multiple of it (each key/value head is then replicated)")
GPUS = ("spec.resources nvidia.com/gpu must equal spec.engine.tensorParallelSize when that "
        "is > 1: one GPU per rank")
CPUS = ("spec.resources cpu must be at least spec.engine.tensorParallelSize + 1 in a CPU pool "
        "of engine kind sluice: a thread per rank, and one CPU for the API process")


def parse_model_shape(shape: Mapping[str, Any] | None) -> ModelShape | None:
    """spec.model.shape; numKeyValueHeads defaults to numAttentionHeads (config.json's rule)."""
    if not shape:
        return None
    heads = int(shape["numAttentionHeads"])
    return ModelShape(heads, int(shape.get("numKeyValueHeads", heads)),
                      int(shape["intermediateSize"]))


def check(pool: PoolSpec) -> None:
    """SpecError with the CRD's message for the first rule `pool` breaks."""
    n = pool.engine.tensor_parallel_size
    if n == 1:
        return
    if not 1 <= n <= MAX_SIZE:
        raise SpecError(f"spec.engine.tensorParallelSize must be 1 to {MAX_SIZE}")
    sluice = pool.engine.kind == "sluice"
    shape = pool.model_shape
    refused = [
        (sluice and pool.lora is not None, LORA),
        (pool.source is None and n not in DEFAULT_MODEL_SIZES, DEFAULT_MODEL),
        (shape is not None and shape.num_attention_heads % n != 0, SHAPE_HEADS),
        (shape is not None and shape.intermediate_size % n != 0, SHAPE_MLP),
        (shape is not None and not _kv_splits(shape.num_key_value_heads, n), SHAPE_KV),
    ]
    for role in pool.roles:
        given = {dict(role.resources.requests).get(GPU), dict(role.resources.limits).get(GPU)}
        refused.append((bool(given - {None, str(n)}), GPUS))
        cpus = guaranteed_cpus(role.resources)
        refused.append((sluice and not is_gpu(role.resources) and cpus is not None
                        and cpus < n + 1, CPUS))
    for broken, message in refused:
        if broken:
            raise SpecError(message)


def _kv_splits(kv_heads: int, n: int) -> bool:
    return kv_heads % n == 0 if kv_heads >= n else n % kv_heads == 0


def is_gpu(resources: Resources) -> bool:
    return GPU in dict(resources.requests) or GPU in dict(resources.limits)


def guaranteed_cpus(resources: Resources) -> float | None:
    """The cpu request, else the cpu limit (Kubernetes requests the limit then); None: neither."""
    value = dict(resources.requests).get("cpu", dict(resources.limits).get("cpu"))
    return None if value is None else quantity(value)


def pod_resources(pool: PoolSpec, resources: Resources) -> dict[str, dict[str, str]]:
    """The engine container's requests and limits: `resources`, with what N ranks need."""
    n = pool.engine.tensor_parallel_size
    out = resources.to_manifest()
    if n == 1:
        return out
    if is_gpu(resources):
        for part in ("requests", "limits"):
            out.setdefault(part, {})[GPU] = str(n)
    elif pool.engine.kind == "sluice" and guaranteed_cpus(resources) is None:
        out.setdefault("requests", {})["cpu"] = str(n + 1)
    return out


def num_threads(pool: PoolSpec, resources: Resources) -> int | None:
    """`--num-threads` of each rank of a CPU pool's sluice engines; None: not rendered (one
    rank, where the engine sizes itself, GPUs, or vLLM, which has no such flag)."""
    n = pool.engine.tensor_parallel_size
    if n == 1 or pool.engine.kind != "sluice" or is_gpu(resources):
        return None
    cpus = guaranteed_cpus(resources)
    return 1 if cpus is None else engine_threads(math.floor(cpus), n)


def shm(pool: PoolSpec) -> dict[str, Any] | None:
    """The emptyDir at /dev/shm; None: the container runtime's own (64 MiB)."""
    n = pool.engine.tensor_parallel_size
    if n > 1:
        return {"medium": "Memory", "sizeLimit": f"{n * SHM_PER_RANK_GI}Gi"}
    if pool.engine.kind == "vllm":  # its API and engine processes share tensors there
        return {"medium": "Memory"}
    return None


_QUANTITY = re.compile(
    r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "P": 1e15, "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "Pi": 2**50, "Ei": 2**60}


def quantity(value: str) -> float:
    """A Kubernetes quantity (crd_types.QUANTITY_PATTERN's grammar) as a number: '500m' 0.5."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise SpecError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = match.groups()
    if suffix and suffix[0] in "eE":
        return float(number + suffix)
    return float(number) * _SUFFIXES.get(suffix or "", 1)
