"""OpenAPI v3 schema of the InferencePool spec (structural, with defaults); the status is
in `crd_status.py`, the building blocks in `crd_types.py`.

The schema is the first line of validation: types, ranges, enums, patterns and defaults
live here; cross-field rules the type system cannot express are CEL rules
(`x-kubernetes-validations`) whose messages are what `kubectl apply` shows. Every field
has a description, so `kubectl explain spool.spec` documents the resource (a test walks
the schema). `sluice.operator.spec` reads the same fields and applies the same defaults,
so a spec that passed the API server always parses.
"""

from __future__ import annotations

from sluice.operator import crd_lora, crd_quant, crd_tp
from sluice.operator.crd_types import (
    Schema,
    cel,
    free_object,
    int_or_percent,
    obj,
    prop,
    quantity,
    rules,
)
from sluice.operator.spec import VLLM_ROLES

ENGINE_KINDS = ("sluice", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("ngram", "draft_model", "early_exit")

def _quantity_map(what: str) -> Schema:
    return {"type": "object", "description": f"{what} per resource name (cpu, memory, "
            "nvidia.com/gpu, ...), each a Kubernetes quantity (500m, 4, 16Gi).",
            "additionalProperties": quantity("A Kubernetes quantity.")}


def resources_schema() -> Schema:
    return obj("Container resources of each engine. GPUs as `nvidia.com/gpu` limits (the "
                "request is set equal to the limit).",
                {"requests": _quantity_map("Requests"), "limits": _quantity_map("Limits")})


def autoscaling_schema() -> Schema:
    return obj(
        "KV-cache and queue driven autoscaling of the replicas by the operator.",
        {
            "enabled": prop("boolean", "Scale the replicas between minReplicas and "
                              "maxReplicas.", default=False),
            "minReplicas": prop("integer", "Fewest replicas.", minimum=1, default=1),
            "maxReplicas": prop("integer", "Most replicas.", minimum=1, maximum=1000,
                                  default=4),
            "targetKVCacheUsage": prop("number", "Mean vllm:kv_cache_usage_perc (0-1] of "
                                         "the ready engines to hold.", exclusiveMinimum=True,
                                         minimum=0, maximum=1, default=0.7),
            "targetQueueDepth": prop("integer", "Mean waiting requests per engine to hold.",
                                       minimum=1, default=8),
            "scaleUpStabilizationSeconds": prop(
                "integer", "A scale-up goes to the lowest recommendation of this window.",
                minimum=0, maximum=3600, default=60),
            "scaleDownStabilizationSeconds": prop(
                "integer", "A scale-down goes to the highest recommendation of this window.",
                minimum=0, maximum=3600, default=300),
        },
        defaulted=True,
        **rules(cel("self.minReplicas <= self.maxReplicas",
                     "autoscaling.minReplicas must be <= autoscaling.maxReplicas")),
    )


def role_schema(role: str) -> Schema:
    return obj(f"The {role} engines: one Deployment `<pool>-{role}`.", {
        "replicas": prop("integer", f"Number of {role} engines.", minimum=0, maximum=1000,
                           default=1),
        "resources": resources_schema(),
        "autoscaling": autoscaling_schema(),
    })


def model_schema() -> Schema:
    secret_ref = obj("A Secret in the pool's namespace holding a Hugging Face token.", {
        "name": prop("string", "The Secret's name.", minLength=1),
        "key": prop("string", "The key of the token in the Secret.", default="token")},
        required=["name"])
    source = obj(
        "Where the weights come from; exactly one of huggingFace, pvc, image. Absent: the "
        "sluice engine's built-in default model.",
        {
            "huggingFace": obj("Download from the Hugging Face Hub into the model cache.", {
                "repo": prop("string", "Repository id, e.g. Qwen/Qwen3-0.6B.", minLength=1,
                               pattern=r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$"),
                "revision": prop("string", "Branch, tag or commit; default: main."),
                "tokenSecretRef": secret_ref}, required=["repo"]),
            "pvc": obj("Weights already on a PersistentVolumeClaim (mounted read-only).", {
                "claimName": prop("string", "The claim, in the pool's namespace.",
                                    minLength=1),
                "path": prop("string", "The model's folder (or .gguf file) on the claim.",
                               default="")}, required=["claimName"]),
            "image": obj("Weights baked into the engine image.", {
                "path": prop("string", "The model's path inside the image.", minLength=1)},
                required=["path"]),
        },
        **rules(cel("[has(self.huggingFace), has(self.pvc), has(self.image)]"
                     ".filter(x, x).size() == 1",
                     "model.source must set exactly one of huggingFace, pvc, image")),
    )
    return obj("The model the pool serves.", {
        "name": prop("string", "Served model name: what clients send as `model` (also the "
                       "pods' annotation sluice.dev/model).", minLength=1, maxLength=253),
        "source": source,
        "shape": crd_tp.model_shape_schema(),
    }, required=["name"])


def engine_schema() -> Schema:
    env_var = obj("An environment variable of the engine container.", {
        "name": prop("string", "Variable name.", minLength=1),
        "value": prop("string", "Literal value (not for tokens: use valueFrom)."),
        "valueFrom": free_object("EnvVarSource: from a Secret, ConfigMap or field.")},
        required=["name"])
    return obj(
        "The inference engine of every replica.",
        {
            "kind": prop("string", "sluice (this project's engine) or vllm.",
                           enum=list(ENGINE_KINDS), default="sluice"),
            "image": prop("string", "Engine image; default: the operator's for the kind."),
            "blockSize": prop("integer", "KV cache block size in tokens.",
                                enum=[8, 16, 32, 64, 128], default=16),
            "maxNumSeqs": prop("integer", "Most sequences in one batch.", minimum=1,
                                 maximum=4096, default=256),
            "maxNumBatchedTokens": prop("integer", "Most tokens in one scheduler step.",
                                          minimum=16, default=2048),
            "maxModelLen": prop("integer", "Longest context; default: the model's.",
                                  minimum=16),
            "gpuMemoryUtilization": prop("number", "Fraction (0-1] of GPU memory for the "
                                           "engine (weights + KV cache).",
                                           exclusiveMinimum=True, minimum=0, maximum=1),
            "kvCacheMemory": prop("string", "CPU KV cache size, e.g. 512MiB (sluice engine "
                                    "only).", pattern=r"^[0-9]+(KiB|MiB|GiB)$"),
            "dtype": prop("string", "Weights and activations type.", enum=list(DTYPES),
                            default="auto"),
            "prefixCaching": prop("boolean", "Reuse the KV cache of shared prefixes.",
                                    default=True),
            "args": prop("array", "Extra engine flags, appended as given.",
                         items=prop("string", "One flag or value.")),
            "env": prop("array", "Extra environment variables.", items=env_var),
            "speculative": speculative_schema(),
            "lora": crd_lora.lora_config_schema(),
            "tensorParallelSize": crd_tp.size_schema(),
            **crd_quant.props(),
        },
        defaulted=True,
        **rules(cel("self.kind == 'sluice' || !has(self.kvCacheMemory)",
                     "engine.kvCacheMemory is only for kind sluice"),
                 cel("self.kind == 'sluice' || !has(self.speculative) || "
                     "self.speculative.method != 'early_exit'",
                     "engine.speculative early_exit is only for kind sluice"),
                 *crd_quant.rules()),
    )


def speculative_schema() -> Schema:
    return obj(
        "Speculative decoding (vLLM's --speculative-config): a cheap proposer drafts tokens "
        "that the model verifies in one step; the output distribution stays the model's.",
        {
            "method": prop("string", "ngram (prompt lookup), draft_model (a smaller model "
                           "with the same vocabulary) or early_exit (the model's own first "
                           "layers; sluice only).", enum=list(SPECULATIVE_METHODS)),
            "numSpeculativeTokens": prop("integer", "Tokens drafted per step.", minimum=1,
                                         maximum=16),
            "promptLookupMin": prop("integer", "ngram: the shortest suffix matched.",
                                    minimum=1),
            "promptLookupMax": prop("integer", "ngram: the longest suffix matched.",
                                    minimum=1),
            "model": prop("string", "draft_model: the draft model's path or repository.",
                          minLength=1),
            "numLayers": prop("integer", "early_exit: how many of the model's first layers "
                              "draft.", minimum=1),
        },
        required=["method", "numSpeculativeTokens"],
        **rules(cel("self.method != 'draft_model' || has(self.model)",
                     "speculative.model is required for draft_model"),
                 cel("self.method != 'early_exit' || has(self.numLayers)",
                     "speculative.numLayers is required for early_exit")),
    )


def rollout_schema() -> Schema:
    return obj(
        "How a spec change replaces running engines (each Deployment's RollingUpdate). The "
        "default starts a new engine before stopping an old one: one spare GPU needed. "
        "maxSurge 0, maxUnavailable 1 needs none, at the cost of one engine less meanwhile.",
        {"maxSurge": int_or_percent("Engines started above the desired count (a number or "
                                    "a percentage).", default=1),
         "maxUnavailable": int_or_percent("Engines stopped below the desired count (a "
                                          "number or a percentage).", default=0)},
        defaulted=True,
        **rules(cel("!(string(self.maxSurge) in ['0', '0%'] && "
                     "string(self.maxUnavailable) in ['0', '0%'])",
                     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0")))


def disruption_schema() -> Schema:
    return obj(
        "The PodDisruptionBudget of each role's engines (voluntary evictions: node drains, "
        "cluster upgrades). Default: at most one engine down at a time.",
        {"enabled": prop("boolean", "Render the PodDisruptionBudgets.", default=True),
         "maxUnavailable": int_or_percent("Engines that may be evicted at once (default 1 "
                                          "when minAvailable is not set)."),
         "minAvailable": int_or_percent("Engines that must stay (instead of "
                                        "maxUnavailable).")},
        defaulted=True,
        **rules(cel("!(has(self.maxUnavailable) && has(self.minAvailable))",
                     "podDisruptionBudget: set maxUnavailable or minAvailable, not both")))


def spec_schema() -> Schema:
    name_ref = obj("A reference by name.", {"name": prop("string", "Name.", minLength=1)},
                    required=["name"])
    return obj(
        "Desired state of an InferencePool: a model served by a set of engine replicas.",
        {
            "model": model_schema(),
            "engine": engine_schema(),
            "replicas": prop("integer", "A plain pool: this many engines in one `serve` "
                               "Deployment (the scale subresource). Not with roles.",
                               minimum=0, maximum=1000),
            "roles": obj("A disaggregated pool: prefill and decode engines, scaled apart. "
                          "Not with replicas.",
                          {"prefill": role_schema("prefill"), "decode": role_schema("decode")},
                          required=["prefill", "decode"]),
            "resources": resources_schema(),
            "autoscaling": autoscaling_schema(),
            "rollout": rollout_schema(),
            "podDisruptionBudget": disruption_schema(),
            "modelCache": obj("Where engines keep downloaded weights.", {
                "sizeLimit": quantity("Size of the emptyDir cache.", default="20Gi"),
                "claimName": prop("string", "A PersistentVolumeClaim instead of the "
                                    "emptyDir (shared by the replicas, kept across restarts).")},
                defaulted=True),
            "nodeSelector": {"type": "object", "description": "The pods' nodeSelector.",
                             "additionalProperties": prop("string", "A node label's value.")},
            "tolerations": prop("array", "The pods' tolerations.",
                                  items=free_object("Toleration")),
            "affinity": free_object("The pods' affinity."),
            "priorityClassName": prop("string", "The pods' priorityClassName."),
            "imagePullSecrets": prop("array", "Secrets for pulling the engine image.",
                                       items=name_ref),
            "serviceAccountName": prop("string", "The pods' ServiceAccount (its token is "
                                         "not mounted: engines never call the API server)."),
            "loras": crd_lora.loras_schema(),
        },
        required=["model"],
        **rules(
            cel("has(self.replicas) != has(self.roles)",
                "set exactly one of spec.replicas (plain pool) or spec.roles "
                "(prefill/decode pool)"),
            cel("has(self.model.source) || self.engine.kind == 'sluice'",
                "engine kind vllm needs spec.model.source"),
            # vLLM reads the prefill engine from llm-d's sidecar, not from our picker's header
            cel("!has(self.roles) || self.engine.kind == 'sluice'", VLLM_ROLES),
            cel("!has(self.roles) || !has(self.autoscaling) || !self.autoscaling.enabled",
                "a prefill/decode pool autoscales per role (spec.roles.<role>.autoscaling), "
                "not with spec.autoscaling"),
            crd_lora.NAME_NOT_MODEL,
            *crd_tp.spec_rules(),
        ),
    )
