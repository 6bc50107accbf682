"""OpenAPI v3 schema of a pool's LoRA adapters (`spec.loras`) and the engines' LoRA limits
(`spec.engine.lora`), with the rules `sources.parse_loras` and `parse_lora_config` check
again for pools the API server did not validate.

Adapter names are the list's map key (`x-kubernetes-list-type: map`): the API server
refuses a name listed twice itself, and server-side apply merges adapters by name.
"""

from __future__ import annotations

from sluice.lora_limits import LORA_RANKS
from sluice.operator.crd_types import Schema, cel, obj, prop, rules
from sluice.operator.sources import LORA_NAME_MAX, LORA_NAME_PATTERN, MAX_ADAPTERS

# (spec-level: it compares with spec.model.name)
NAME_NOT_MODEL = cel("!has(self.loras) || self.loras.all(l, l.name != self.model.name)",
                     "a LoRA adapter cannot take the model's served name (spec.model.name)")


def lora_config_schema() -> Schema:
    return obj(
        "LoRA on the engines (their --enable-lora, --max-loras, --max-lora-rank, "
        "--max-cpu-loras). Set, even empty, to start engines LoRA-capable before any adapter "
        "is listed; without it, listing the first adapter or removing the last restarts "
        "them. A change of these limits restarts them too (a rolling update).",
        {
            "maxLoras": prop("integer", "Adapters in one batch.", minimum=1, maximum=256,
                             default=1),
            "maxLoraRank": prop("integer", "Highest adapter rank the engines accept (vLLM's "
                                "choices).", enum=list(LORA_RANKS), default=16),
            "maxCpuLoras": prop("integer", "Adapters kept in CPU memory (at least maxLoras); "
                                "default: the engine's (maxLoras).", minimum=1),
        },
        **rules(cel("!has(self.maxCpuLoras) || self.maxCpuLoras >= self.maxLoras",
                    "engine.lora.maxCpuLoras must be >= engine.lora.maxLoras")))


def _adapter_source() -> Schema:
    return obj(
        "Where the adapter's files come from; exactly one of huggingFace, pvc, image.",
        {
            "huggingFace": obj(
                "A Hub repository, downloaded by each engine when it loads the adapter (into "
                "the model cache, with the pool's HF_TOKEN if it has one), at its default "
                "branch: the load endpoint takes no revision (pin one with a pvc or image).",
                {"repo": prop("string", "Repository id, e.g. org/sql-lora.", minLength=1,
                              pattern=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")},
                required=["repo"]),
            "pvc": obj(
                "Files on a PersistentVolumeClaim, mounted read-only in every engine. A claim "
                "no adapter (or the model) mounted before restarts the engines to mount it; "
                "adapters added on a mounted claim load without a restart.",
                {"claimName": prop("string", "The claim, in the pool's namespace.",
                                   minLength=1),
                 "path": prop("string", "The adapter's folder on the claim.", default="")},
                required=["claimName"]),
            "image": obj("Files baked into the engine image.", {
                "path": prop("string", "The adapter's folder inside the image.", minLength=1)},
                required=["path"]),
        },
        **rules(cel("[has(self.huggingFace), has(self.pvc), has(self.image)]"
                    ".filter(x, x).size() == 1",
                    "a LoRA adapter's source must set exactly one of huggingFace, pvc, image")))


def loras_schema() -> Schema:
    adapter = obj("A LoRA adapter of the model, served under its own name.", {
        "name": prop("string", "What clients send as `model` to use the adapter.",
                     minLength=1, maxLength=LORA_NAME_MAX, pattern=LORA_NAME_PATTERN),
        "source": _adapter_source(),
    }, required=["name", "source"])
    return prop(
        "array", "LoRA adapters loaded into every ready engine at run time (POST "
        "/v1/load_lora_adapter), and unloaded when removed: changing the list restarts no "
        "engine. status.loras counts the engines serving each.",
        items=adapter, maxItems=MAX_ADAPTERS,
        **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
