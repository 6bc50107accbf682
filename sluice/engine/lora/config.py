"""LoRA flags as vLLM's: --enable-lora, --lora-modules, --max-loras, --max-lora-rank,
--max-cpu-loras."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sluice.lora_limits import LORA_RANKS


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: invalid JSON: {exc}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                    not isinstance(obj.get("path"), str):
                raise ValueError('--lora-modules JSON needs string "name" and "path"')
            unknown = set(obj) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)}")
            entry = cls(obj["name"], obj["path"], obj.get("base_model_name"))
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules expects name=path or JSON, got {text!r}")
            entry = cls(name.strip(), path.strip())
        check_lora_name(entry.name)
        if not entry.path:
            raise ValueError(f"--lora-modules {entry.name}: empty path")
        return entry


def check_lora_name(name: str) -> None:
    """An adapter name is what clients send as `model`: printable, no spaces or commas
    (the `vllm:lora_requests_info` labels list names comma-separated)."""
    if not name or len(name) > 256 or not name.isprintable() or any(
            c in name for c in " ,\t"):
        raise ValueError(f"invalid LoRA adapter name {name!r}: 1-256 printable characters, "
                         "no spaces or commas")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # distinct adapters in one step (batch slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU); None: max_loras
    modules: tuple[LoRAModulePath, ...] = ()  # loaded at startup

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"--max-lora-rank must be one of {LORA_RANKS}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names repeat: {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras
