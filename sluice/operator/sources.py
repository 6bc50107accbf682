"""Where weights come from: the model's source (`spec.model.source`) and its LoRA
adapters' (`spec.loras`), parsed from the pool as the API server returns it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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


def parse_source(s: Mapping[str, Any] | None) -> ModelSource:
    if not s:
        return None
    kinds = [k for k in ("huggingFace", "pvc", "image") if k in s]
    if len(kinds) != 1:
        raise SpecError("model.source must set exactly one of huggingFace, pvc, image")
    if "huggingFace" in s:
        hf = s["huggingFace"]
        ref = hf.get("tokenSecretRef") or {}
        return HuggingFaceSource(hf["repo"], hf.get("revision") or None, ref.get("name"),
                                 ref.get("key", "token"))
    if "pvc" in s:
        return PvcSource(s["pvc"]["claimName"], s["pvc"].get("path", ""))
    return ImageSource(s["image"]["path"])
