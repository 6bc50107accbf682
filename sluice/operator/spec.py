"""Typed, frozen view of an InferencePool: what the renderer and the autoscaler read.

`PoolSpec.from_body(body)` accepts the object as the API server returns it. It applies
the same defaults as the CRD schema (`crd_schema`), so it also works on objects that
were never defaulted (unit tests, older stored versions), and raises `SpecError` with
a user-facing message for what the schema cannot catch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.model_shape import ModelShape
from sluice.operator import tensor_parallel
from sluice.operator.sources import (
    LoraAdapter,
    LoraConfig,
    ModelSource,
    SpecError,
    parse_lora_config,
    parse_loras,
    parse_source,
)

SERVE, PREFILL, DECODE = "serve", "prefill", "decode"


# (also the CRD's rule; a pool stored before it gets this as its Degraded message)
VLLM_ROLES = ("prefill/decode roles need engine kind sluice: a vllm pool would need llm-d's "
              "routing sidecar on its decode pods, which Sluice does not run")


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_usage: float = 0.7
    target_queue_depth: int = 8
    scale_up_stabilization_s: int = 60
    scale_down_stabilization_s: int = 300


@dataclass(frozen=True)
class Resources:
    requests: tuple[tuple[str, str], ...] = ()
    limits: tuple[tuple[str, str], ...] = ()

    def to_manifest(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        limits = dict(self.limits)
        requests = dict(self.requests)
        for name, value in limits.items():  # extended resources: request must equal limit
            if "/" in name:
                requests.setdefault(name, value)
        if requests:
            out["requests"] = requests
        if limits:
            out["limits"] = limits
        return out

    @property
    def gpus(self) -> int:
        return int(dict(self.limits).get("nvidia.com/gpu", dict(self.requests).get(
            "nvidia.com/gpu", "0")))


IntOrPercent = int | str  # a count, or a percentage such as "25%"


@dataclass(frozen=True)
class RolloutSpec:
    """Each Deployment's RollingUpdate: a new engine first, by default (one spare GPU)."""

    max_surge: IntOrPercent = 1
    max_unavailable: IntOrPercent = 0


@dataclass(frozen=True)
class DisruptionSpec:
    """Each role's PodDisruptionBudget; `min_available` replaces `max_unavailable`."""

    enabled: bool = True
    max_unavailable: IntOrPercent | None = 1
    min_available: IntOrPercent | None = None


@dataclass(frozen=True)
class RoleSpec:
    """One Deployment's worth of engines: `serve` for a plain pool, else prefill/decode."""

    name: str
    replicas: int
    resources: Resources
    autoscaling: AutoscalingSpec


@dataclass(frozen=True)
class EngineSpec:
    kind: str = "sluice"
    image: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory: str | None = None
    dtype: str = "auto"
    prefix_caching: bool = True
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    # --speculative-config as the engines take it (vLLM's JSON keys); None: no speculation
    speculative: tuple[tuple[str, Any], ...] | None = None
    lora: LoraConfig | None = None  # spec.engine.lora as given (see PoolSpec.lora)
    tensor_parallel_size: int = 1  # ranks per engine (tensor_parallel.py)
    quantization: str | None = None  # --quantization (crd_quant.py)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype


@dataclass(frozen=True)
class PoolSpec:
    name: str
    namespace: str
    uid: str
    generation: int
    model_name: str
    source: ModelSource
    engine: EngineSpec
    roles: tuple[RoleSpec, ...]
    disaggregated: bool
    rollout: RolloutSpec = RolloutSpec()
    disruption: DisruptionSpec = DisruptionSpec()
    cache_size_limit: str = "20Gi"
    cache_claim: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    loras: tuple[LoraAdapter, ...] = ()
    model_shape: ModelShape | None = None  # spec.model.shape, as given

    @property
    def lora(self) -> LoraConfig | None:
        """The engines' LoRA limits: spec.engine.lora, else its defaults while adapters are
        listed; None: engines without LoRA."""
        return self.engine.lora or (LoraConfig() if self.loras else None)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PoolSpec:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        model = spec.get("model") or {}
        if not model.get("name"):
            raise SpecError("spec.model.name is required")
        engine = _engine(spec.get("engine") or {})
        source = parse_source(model.get("source"))
        if source is None and engine.kind != "sluice":
            raise SpecError("engine kind vllm needs spec.model.source")
        roles_spec = spec.get("roles")
        if (spec.get("replicas") is None) == (roles_spec is None):
            raise SpecError("set exactly one of spec.replicas or spec.roles")
        if roles_spec is not None and engine.kind != "sluice":
            raise SpecError(VLLM_ROLES)
        pool_resources = _resources(spec.get("resources"))
        if roles_spec is None:
            roles = (RoleSpec(SERVE, int(spec["replicas"]), pool_resources,
                              _autoscaling(spec.get("autoscaling"))),)
        else:
            roles = tuple(_role(name, roles_spec.get(name), pool_resources)
                          for name in (PREFILL, DECODE))
        cache = spec.get("modelCache") or {}
        pool = cls(
            name=meta["name"], namespace=meta.get("namespace") or "default",
            uid=meta.get("uid", ""), generation=int(meta.get("generation") or 0),
            model_name=model["name"], source=source, engine=engine, roles=roles,
            disaggregated=roles_spec is not None,
            rollout=_rollout(spec.get("rollout")),
            disruption=_disruption(spec.get("podDisruptionBudget")),
            cache_size_limit=str(cache.get("sizeLimit", "20Gi")),
            cache_claim=cache.get("claimName"),
            node_selector=tuple(sorted((spec.get("nodeSelector") or {}).items())),
            tolerations=tuple(spec.get("tolerations") or ()),
            affinity=spec.get("affinity"),
            priority_class_name=spec.get("priorityClassName"),
            image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or ()),
            service_account_name=spec.get("serviceAccountName"),
            labels=dict(meta.get("labels") or {}),
            loras=parse_loras(spec.get("loras"), model["name"]),
            model_shape=tensor_parallel.parse_model_shape(model.get("shape")),
        )
        tensor_parallel.check(pool)
        return pool

    def role(self, name: str) -> RoleSpec:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)


# Hugging Face reads its token from these: a literal value would sit in the pool's spec
# (readable by anyone who can read the pool) instead of in a Secret.
_TOKEN_VARS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})


def _engine(e: Mapping[str, Any]) -> EngineSpec:
    for var in e.get("env") or ():
        if var.get("name") in _TOKEN_VARS and "valueFrom" not in var:
            raise SpecError(f"spec.engine.env {var['name']} must come from a Secret "
                            "(valueFrom.secretKeyRef, or model.source.huggingFace.tokenSecret)")
    return EngineSpec(
        kind=e.get("kind", "sluice"), image=e.get("image") or None,
        block_size=int(e.get("blockSize", 16)), max_num_seqs=int(e.get("maxNumSeqs", 256)),
        max_num_batched_tokens=int(e.get("maxNumBatchedTokens", 2048)),
        max_model_len=e.get("maxModelLen"),
        gpu_memory_utilization=e.get("gpuMemoryUtilization"),
        kv_cache_memory=e.get("kvCacheMemory"), dtype=e.get("dtype", "auto"),
        prefix_caching=bool(e.get("prefixCaching", True)),
        args=tuple(e.get("args") or ()), env=tuple(e.get("env") or ()),
        speculative=_speculative(e.get("speculative"), e.get("kind", "sluice")),
        lora=parse_lora_config(e.get("lora")),
        tensor_parallel_size=int(e.get("tensorParallelSize", 1)),
        quantization=e.get("quantization"), kv_cache_dtype=e.get("kvCacheDtype", "auto"),
    )


_SPECULATIVE_KEYS = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens",
                     "promptLookupMin": "prompt_lookup_min",
                     "promptLookupMax": "prompt_lookup_max", "model": "model",
                     "numLayers": "num_layers"}


def _speculative(s: Mapping[str, Any] | None, kind: str) -> tuple[tuple[str, Any], ...] | None:
    """spec.engine.speculative in vLLM's --speculative-config keys (the schema's rules,
    checked again for pools the API server did not validate)."""
    if not s:
        return None
    method = s.get("method")
    if method == "draft_model" and not s.get("model"):
        raise SpecError("spec.engine.speculative.model is required for draft_model")
    if method == "early_exit" and (kind != "sluice" or not s.get("numLayers")):
        raise SpecError("spec.engine.speculative early_exit needs kind sluice and numLayers")
    return tuple((_SPECULATIVE_KEYS[k], v) for k, v in s.items() if k in _SPECULATIVE_KEYS)


def _resources(r: Mapping[str, Any] | None) -> Resources:
    r = r or {}
    return Resources(
        requests=tuple(sorted((k, str(v)) for k, v in (r.get("requests") or {}).items())),
        limits=tuple(sorted((k, str(v)) for k, v in (r.get("limits") or {}).items())),
    )


def _rollout(r: Mapping[str, Any] | None) -> RolloutSpec:
    r = r or {}
    spec = RolloutSpec(max_surge=r.get("maxSurge", 1), max_unavailable=r.get("maxUnavailable", 0))
    if str(spec.max_surge) in ("0", "0%") and str(spec.max_unavailable) in ("0", "0%"):
        raise SpecError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
    return spec


def _disruption(d: Mapping[str, Any] | None) -> DisruptionSpec:
    d = d or {}
    if "maxUnavailable" in d and "minAvailable" in d:
        raise SpecError("podDisruptionBudget: set maxUnavailable or minAvailable, not both")
    return DisruptionSpec(enabled=bool(d.get("enabled", True)),
                          max_unavailable=None if "minAvailable" in d else d.get(
                              "maxUnavailable", 1),
                          min_available=d.get("minAvailable"))


def _autoscaling(a: Mapping[str, Any] | None) -> AutoscalingSpec:
    a = a or {}
    spec = AutoscalingSpec(
        enabled=bool(a.get("enabled", False)),
        min_replicas=int(a.get("minReplicas", 1)), max_replicas=int(a.get("maxReplicas", 4)),
        target_kv_cache_usage=float(a.get("targetKVCacheUsage", 0.7)),
        target_queue_depth=int(a.get("targetQueueDepth", 8)),
        scale_up_stabilization_s=int(a.get("scaleUpStabilizationSeconds", 60)),
        scale_down_stabilization_s=int(a.get("scaleDownStabilizationSeconds", 300)),
    )
    if spec.min_replicas > spec.max_replicas:
        raise SpecError("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
    return spec


def _role(name: str, r: Mapping[str, Any] | None, pool_resources: Resources) -> RoleSpec:
    if r is None:
        raise SpecError(f"spec.roles.{name} is required in a prefill/decode pool")
    resources = _resources(r.get("resources")) if r.get("resources") else pool_resources
    return RoleSpec(name, int(r.get("replicas", 1)), resources, _autoscaling(r.get("autoscaling")))
