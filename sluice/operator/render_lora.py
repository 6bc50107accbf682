"""What a pool's engine pods need for LoRA besides their flags (`engine_args.lora_args`):
vLLM's switch for the runtime load endpoints, and the claims that hold pvc adapters.

Nothing here depends on the adapter list itself, only on LoRA being on and on which claims
the adapters use, so adding or removing an adapter keeps the pod template as it is (no
rollout). A claim mounts once, at `/loras/<claim>`; the model's own claim is already at
`/models`. Where an adapter's folder is in a given pod, `lora.py` reads from that pod's spec.
"""

from __future__ import annotations

import hashlib
from typing import Any

from sluice.operator.sources import PvcSource
from sluice.operator.spec import PoolSpec

LORA_MOUNT_DIR = "/loras"
# vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set
VLLM_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_env(pool: PoolSpec) -> list[dict[str, Any]]:
    """(A variable spec.engine.env already sets is left to it: one name, one entry.)"""
    if pool.lora is None or pool.engine.kind != "vllm":
        return []
    if any(e.get("name") == VLLM_RUNTIME_LORA for e in pool.engine.env):
        return []
    return [{"name": VLLM_RUNTIME_LORA, "value": "True"}]


def adapter_claims(pool: PoolSpec) -> list[str]:
    """The claims the adapters need mounted, but the model's (mounted already), sorted."""
    model_claim = pool.source.claim_name if isinstance(pool.source, PvcSource) else None
    return sorted({a.source.claim_name for a in pool.loras
                   if isinstance(a.source, PvcSource) and a.source.claim_name != model_claim})


def volume_name(claim: str) -> str:
    """A DNS label for any claim name (a claim may be 253 characters long, dots included)."""
    return "lora-" + hashlib.sha256(claim.encode()).hexdigest()[:10]


def adapter_volumes(pool: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes, mounts = [], []
    for claim in adapter_claims(pool):
        name = volume_name(claim)
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim,
                                                                "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{LORA_MOUNT_DIR}/{claim}",
                       "readOnly": True})
    return volumes, mounts
