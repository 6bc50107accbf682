"""Where weights come from: the model's source (`spec.model.source`) and its LoRA
adapters' (`spec.loras`), parsed from the pool as the API server returns it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.lora_limits import LORA_RANKS


class SpecError(ValueError):
    """The spec cannot be rendered; the message is shown in the Degraded condition."""


@dataclass(frozen=True)
class HuggingFaceSource:
    repo: str
    revision: str | None = None
    token_secret: str | None = None
    token_key: str = "token"


@dataclass(frozen=True)
class PvcSource:
    claim_name: str
    path: str = ""


@dataclass(frozen=True)
class ImageSource:
    path: str


ModelSource = HuggingFaceSource | PvcSource | ImageSource | None


def parse_source(s: Mapping[str, Any] | None, what: str = "model.source") -> ModelSource:
    if not s:
        return None
    kinds = [k for k in ("huggingFace", "pvc", "image") if k in s]
    if len(kinds) != 1:
        raise SpecError(f"{what} must set exactly one of huggingFace, pvc, image")
    if "huggingFace" in s:
        hf = s["huggingFace"]
        ref = hf.get("tokenSecretRef") or {}
        return HuggingFaceSource(hf["repo"], hf.get("revision") or None, ref.get("name"),
                                 ref.get("key", "token"))
    if "pvc" in s:
        return PvcSource(s["pvc"]["claimName"], s["pvc"].get("path", ""))
    return ImageSource(s["image"]["path"])


# What clients send as `model` for an adapter: the characters of Hub repository ids.
LORA_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$"
LORA_NAME_MAX = 128
# Adapters per pool: each one is a load request to every new engine before it serves the
# adapter; a longer catalogue belongs in an adapter registry the engine resolves on demand.
MAX_ADAPTERS = 64


@dataclass(frozen=True)
class LoraConfig:
    """`spec.engine.lora`: the engines' LoRA limits (their flags: a change restarts them)."""

    max_loras: int = 1  # adapters in one batch
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in CPU memory; None: the engine's default


@dataclass(frozen=True)
class LoraAdapter:
    """One entry of `spec.loras`: loaded into running engines, never in their flags."""

    name: str
    source: HuggingFaceSource | PvcSource | ImageSource


def parse_lora_config(c: Mapping[str, Any] | None) -> LoraConfig | None:
    if c is None:
        return None
    config = LoraConfig(max_loras=int(c.get("maxLoras", 1)),
                        max_lora_rank=int(c.get("maxLoraRank", 16)),
                        max_cpu_loras=c.get("maxCpuLoras"))
    if config.max_loras < 1:
        raise SpecError("engine.lora.maxLoras must be at least 1")
    if config.max_lora_rank not in LORA_RANKS:
        raise SpecError(f"engine.lora.maxLoraRank must be one of {list(LORA_RANKS)}")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise SpecError("engine.lora.maxCpuLoras must be >= engine.lora.maxLoras")
    return config


def parse_loras(items: list[Mapping[str, Any]] | None, model_name: str) -> tuple[LoraAdapter, ...]:
    """`spec.loras`, checked again for pools the API server did not validate."""
    adapters = []
    for item in items or ():
        name = str(item.get("name") or "")
        if not name or name == model_name or name in {a.name for a in adapters}:
            raise SpecError(f"spec.loras: adapter name {name!r} is empty, taken by the model "
                            "or listed twice")
        source = item.get("source") or {}
        if "huggingFace" in source and set(source["huggingFace"]) - {"repo"}:
            raise SpecError(f"spec.loras {name}: an adapter's huggingFace source takes a repo "
                            "only (the engines' load endpoint takes no revision or token)")
        parsed = parse_source(source, f"spec.loras {name}: source")
        if parsed is None:
            raise SpecError(f"spec.loras {name}: a source is required")
        adapters.append(LoraAdapter(name, parsed))
    if len(adapters) > MAX_ADAPTERS:
        raise SpecError(f"spec.loras: at most {MAX_ADAPTERS} adapters")
    return tuple(adapters)
