"""`--speculative-config`: vLLM's JSON shape, parsed into a typed, frozen config.

Accepted (vLLM's keys; unknown keys are an error, not ignored):
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a,
     "prompt_lookup_max": b}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
    {"method": "early_exit", "num_layers": L, "num_speculative_tokens": k}
plus, for any method, "disable_by_batch_size": N (no drafts in a step whose batch of
running requests has N or more: large batches are compute-bound and speculation only
adds work) and, for draft_model, "load_format" ("auto" | "dummy", random weights).
A "model" without a "method" means draft_model, as in vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "early_exit")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "model", "num_layers", "disable_by_batch_size", "load_format"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model
    load_format: str = "auto"  # draft_model: auto | dummy
    num_layers: int = 0  # early_exit
    disable_by_batch_size: int = 0  # 0: never disabled

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}; supported: {', '.join(METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.method == "ngram" and not (
                1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64):
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64")
        if self.method == "draft_model" and not self.model:
            raise ValueError("draft_model needs \"model\" (a path, or a named shape with "
                             "\"load_format\": \"dummy\")")
        if self.method == "early_exit" and self.num_layers < 1:
            raise ValueError("early_exit needs \"num_layers\" >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys: {', '.join(unknown)}")
        d = dict(d)
        if "method" not in d and d.get("model"):
            d["method"] = "draft_model"
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ValueError("--speculative-config needs \"method\" and \"num_speculative_tokens\"")
        if d["method"] == "ngram":  # vLLM: a missing bound takes the other's value
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            d["prompt_lookup_min"] = lo if lo is not None else (hi if hi is not None else 1)
            d["prompt_lookup_max"] = hi if hi is not None else max(d["prompt_lookup_min"], 4)
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "num_layers", "disable_by_batch_size"):
            if key in d and (not isinstance(d[key], int) or isinstance(d[key], bool)):
                raise ValueError(f"--speculative-config {key} must be an integer")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise TypeError("--speculative-config must be a JSON object")
        return cls.from_dict(d)
