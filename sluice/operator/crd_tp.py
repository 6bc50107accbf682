"""OpenAPI v3 schema of tensor parallelism (`spec.engine.tensorParallelSize`, and the
optional `spec.model.shape` that lets the API server check it), with the CEL rules whose
messages `tensor_parallel` owns and applies again for pools the API server did not
validate.

The tensor-parallel size is `self.engine.tensorParallelSize` in every rule: the engine
object and the field are defaulted (1) before the rules run.
"""

from __future__ import annotations

from sluice.operator import tensor_parallel as tp
from sluice.operator.crd_types import Schema, cel, obj, prop

N = "self.engine.tensorParallelSize"
SHAPE = "self.model.shape"
_GPU = f"'{tp.GPU}'"


def size_schema() -> Schema:
    return prop(
        "integer", "Split each engine over this many ranks in its pod (--tensor-parallel-size, "
        "both kinds): GPUs 0..N-1, or on CPUs N core groups of the sluice engine. The "
        "model's attention heads and MLP must divide by it, its key/value heads too (or it "
        "must be a multiple of them). A GPU pool's nvidia.com/gpu must equal it. A sluice "
        "CPU pool's cpu request (at least N + 1; requested when absent) gives each rank "
        "(cpu - 1) / N threads, one CPU being the API process's.",
        minimum=1, maximum=tp.MAX_SIZE, default=1)


def model_shape_schema() -> Schema:
    return obj(
        "The model's shape, from its config.json: optional, it lets the API server refuse a "
        "tensorParallelSize that does not split the model (the engine would fail at start).",
        {"numAttentionHeads": prop("integer", "config.json num_attention_heads.", minimum=1),
         "numKeyValueHeads": prop("integer", "config.json num_key_value_heads; default: "
                                  "numAttentionHeads.", minimum=1),
         "intermediateSize": prop("integer", "config.json intermediate_size (the MLP's).",
                                  minimum=1)},
        required=["numAttentionHeads", "intermediateSize"])


def _on_resources(condition: str) -> str:
    """`condition` (on the map `$m`) for spec.resources.limits and .requests, each true where
    it is absent."""
    parts = [f"(!has(self.resources.{p}) || {condition.replace('$m', f'self.resources.{p}')})"
             for p in ("limits", "requests")]
    return "!has(self.resources) || (" + " && ".join(parts) + ")"


def _named(part: str, key: str) -> str:
    return f"(has(self.resources.{part}) && {key} in self.resources.{part})"


def spec_rules() -> list[Schema]:
    """The spec-level rules (self: spec), each true when N is 1."""
    one = f"{N} == 1 || "
    gpu_equal = f"!({_GPU} in $m) || string($m[{_GPU}]) == string({N})"
    cpu_enough = ("!('cpu' in $m) || "
                  f"quantity(string($m['cpu'])).asApproximateFloat() >= double({N} + 1)")
    gpu_pool = f"has(self.resources) && ({_named('limits', _GPU)} || {_named('requests', _GPU)})"
    sizes = ", ".join(map(str, tp.DEFAULT_MODEL_SIZES))
    return [
        cel(one + "self.engine.kind != 'sluice' || (!has(self.engine.lora) && "
            "(!has(self.loras) || self.loras.size() == 0))", tp.LORA),
        cel(one + f"has(self.model.source) || {N} in [{sizes}]", tp.DEFAULT_MODEL),
        cel(one + f"!has({SHAPE}) || {SHAPE}.numAttentionHeads % {N} == 0", tp.SHAPE_HEADS),
        cel(one + f"!has({SHAPE}) || {SHAPE}.intermediateSize % {N} == 0", tp.SHAPE_MLP),
        cel(one + f"!has({SHAPE}) || !has({SHAPE}.numKeyValueHeads) || "
            f"({SHAPE}.numKeyValueHeads >= {N} ? {SHAPE}.numKeyValueHeads % {N} == 0 "
            f": {N} % {SHAPE}.numKeyValueHeads == 0)", tp.SHAPE_KV),
        cel(one + _on_resources(gpu_equal), tp.GPUS),
        cel(one + f"self.engine.kind != 'sluice' || ({gpu_pool}) || "
            + _on_resources(cpu_enough), tp.CPUS),
    ]
