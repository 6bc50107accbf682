"""OpenAPI v3 schema of quantized weights and KV cache in `spec.engine`: `quantization`
(`--quantization`) and `kvCacheDtype` (`--kv-cache-dtype`), and the CEL rules for what the
sluice engine takes: GGUF blocks kept (`gguf`), fp8 weights, GPTQ / AWQ int4 checkpoints,
each on one rank and without LoRA adapters, and a KV cache in the model's dtype or fp8
e4m3. vLLM takes its own methods and fp8 caches.
"""

from __future__ import annotations

from sluice.operator.crd_types import Schema, cel, prop

# vLLM's --quantization methods people deploy, and the sluice engine's (gguf)
QUANTIZATIONS = ("gguf", "awq", "awq_marlin", "gptq", "gptq_marlin", "fp8", "compressed-tensors",
                 "bitsandbytes")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def props() -> dict[str, Schema]:
    return {
        "quantization": prop(
            "string", "How the weights are quantized (--quantization). The sluice engine "
            "takes gguf (a GGUF model file's blocks kept and multiplied as stored), fp8 (e4m3 "
            "weights: a checkpoint's, or quantized at load), gptq and awq (int4 checkpoints); "
            "vLLM takes its methods. Default: the checkpoint's own method, else its weights "
            "in dtype.", enum=list(QUANTIZATIONS)),
        "kvCacheDtype": prop(
            "string", "The KV cache's type (--kv-cache-dtype): auto (dtype), or fp8 / fp8_e4m3 "
            "(one byte per value: twice the blocks in the same memory); fp8_e5m2 on vLLM "
            "only.", enum=list(KV_CACHE_DTYPES), default="auto"),
    }


def rules() -> list[Schema]:
    """Engine-level rules (self: spec.engine)."""
    sluice_quantized = "self.kind != 'sluice' || !has(self.quantization) || "
    return [
        cel(sluice_quantized + "self.quantization in ['gguf', 'fp8', 'gptq', 'awq']",
            "engine.quantization: the sluice engine takes gguf, fp8, gptq or awq"),
        cel(sluice_quantized + "(self.tensorParallelSize == 1 && !has(self.lora))",
            "engine.quantization on the sluice engine needs tensorParallelSize 1 and no "
            "engine.lora"),
        cel("self.kind != 'sluice' || self.kvCacheDtype != 'fp8_e5m2'",
            "engine.kvCacheDtype fp8_e5m2 needs engine kind vllm (the sluice engine's fp8 "
            "is e4m3)"),
    ]
