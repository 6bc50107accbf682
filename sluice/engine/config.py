"""Typed, frozen engine configuration."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sluice.engine.kv_transfer.config import KVTransferConfig
from sluice.engine.lora.config import LoRAConfig
from sluice.engine.models.registry import architecture_of
from sluice.engine.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape, read from a Hugging Face `config.json` dict."""

    model_type: str
    architecture: str  # the family (models/registry.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # a bias on q/k/v (Qwen2 has one whatever this says)
    rope_scaling: tuple[tuple[str, object], ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        architecture = architecture_of(cfg)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_scaling=tuple(sorted(scaling.items())) if rope_type != "default" else (),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def num_params(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


# --kv-cache-dtype's names (vLLM's): the model's dtype, or float8 e4m3 (attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 512 << 20  # bytes, CPU budget
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # overrides the memory budget (tests)
    # --kv-cache-dtype (attention/kv_quant.py): auto (the model's dtype) | fp8 | fp8_e4m3
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, (
            "block_size must be a power of two"
        )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.cache_dtype!r}: choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # vLLM's long_prefill_token_threshold: a request computes at most this many prompt
    # tokens per step (0: no cap), so a long prefill shares each step with short ones
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None  # None: the model's and the pool's limit
    max_waiting_requests: int = 1024
    policy: str = "fcfs"  # --scheduling-policy (sched_policy.py): fcfs | priority

    def __post_init__(self) -> None:
        assert self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold >= 0"
        assert self.policy in ("fcfs", "priority"), f"unknown scheduling policy {self.policy!r}"


@dataclass(frozen=True)
class ParallelConfig:
    """--tensor-parallel-size: the model split over this many ranks (GPUs, or CPU core
    groups), one process each (distributed/)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    served_model_name: str
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu on CPU) | cpu | torch | triton
    enforce_eager: bool = False  # no CUDA graphs
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: off
    kv_transfer: KVTransferConfig | None = None  # disaggregated prefill/decode (kv_transfer/)
    lora: LoRAConfig | None = None  # --enable-lora (lora/); None: base model only
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # --quantization (layers/quantization.py): gguf, a GGUF file's quantized blocks kept
    # and multiplied as stored; fp8, e4m3 weights (quantized at load unless the checkpoint
    # stores them); gptq, awq: a checkpoint's int4 weights (the checkpoint's config decides
    # anyway); None: the checkpoint's own method, else its weights in --dtype
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None:
            self._check_quantization()
        if self.parallel.tensor_parallel_size == 1:
            return
        if self.lora is not None:
            raise ValueError("--enable-lora is not supported with --tensor-parallel-size > 1")

    def _check_quantization(self) -> None:
        q = self.quantization
        if q not in ("gguf", "fp8", "gptq", "awq"):
            raise ValueError(f"--quantization {q!r}: choose gguf, fp8, gptq or awq")
        if (q == "gguf") != self.model.endswith(".gguf") or self.load_format == "dummy":
            raise ValueError("--quantization gguf takes a .gguf model file, fp8 a "
                             "Hugging Face folder (so do gptq and awq)")
        if self.lora is not None or self.parallel.tensor_parallel_size > 1:
            raise ValueError(f"--quantization {q} is not supported with --enable-lora or "
                             "--tensor-parallel-size > 1")


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2e9; plain numbers are bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot parse size {text!r} (examples: 512MiB, 2GiB, 1e9)")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    return int(number * base ** " KMGT".index(unit or " "))
