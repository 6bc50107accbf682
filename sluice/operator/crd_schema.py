"""OpenAPI v3 schema of the InferencePool spec and status (structural, with defaults).

The schema is the first line of validation: types, ranges, enums and defaults live
here; cross-field rules the type system cannot express are CEL rules
(`x-kubernetes-validations`) whose messages are what `kubectl apply` shows.
`sluice.operator.spec` reads the same fields and applies the same defaults, so a
spec that passed the API server always parses.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

ENGINE_KINDS = ("sluice", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _obj(properties: Schema, required: list[str] | None = None, **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = required
    return schema


def _free_object(description: str) -> Schema:
    """A Kubernetes type we pass through to the pod as is (validated by the API server there)."""
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "description": description}


def _quantity_map() -> Schema:
    return {"type": "object",
            "additionalProperties": {"x-kubernetes-int-or-string": True,
                                     "anyOf": [{"type": "integer"}, {"type": "string"}]}}


def resources_schema() -> Schema:
    return _obj({"requests": _quantity_map(), "limits": _quantity_map()},
                description="Container resources; GPUs as `nvidia.com/gpu` (limits).")


def autoscaling_schema() -> Schema:
    return _obj(
        {
            "enabled": {"type": "boolean", "default": False},
            "minReplicas": {"type": "integer", "minimum": 1, "default": 1},
            "maxReplicas": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 4},
            "targetKVCacheUsage": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                   "maximum": 1, "default": 0.7,
                                   "description": "Mean vllm:kv_cache_usage_perc to hold."},
            "targetQueueDepth": {"type": "integer", "minimum": 1, "default": 8,
                                 "description": "Mean waiting requests per replica to hold."},
            "scaleUpStabilizationSeconds": {"type": "integer", "minimum": 0, "maximum": 3600,
                                            "default": 60},
            "scaleDownStabilizationSeconds": {"type": "integer", "minimum": 0,
                                              "maximum": 3600, "default": 300},
        },
        default={},
        **{"x-kubernetes-validations": [{
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas"}]},
    )


def role_schema() -> Schema:
    return _obj({
        "replicas": {"type": "integer", "minimum": 0, "maximum": 1000, "default": 1},
        "resources": resources_schema(),
        "autoscaling": autoscaling_schema(),
    })


def model_schema() -> Schema:
    secret_ref = _obj({"name": {"type": "string", "minLength": 1},
                       "key": {"type": "string", "default": "token"}}, required=["name"])
    source = _obj(
        {
            "huggingFace": _obj({"repo": {"type": "string", "minLength": 1,
                                          "pattern": r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$"},
                                 "revision": {"type": "string"},
                                 "tokenSecretRef": secret_ref}, required=["repo"]),
            "pvc": _obj({"claimName": {"type": "string", "minLength": 1},
                         "path": {"type": "string", "default": ""}}, required=["claimName"]),
            "image": _obj({"path": {"type": "string", "minLength": 1}}, required=["path"]),
        },
        description="Where the weights come from; exactly one of huggingFace, pvc, image. "
                    "Absent: the sluice engine's built-in default model.",
        **{"x-kubernetes-validations": [{
            "rule": "[has(self.huggingFace), has(self.pvc), has(self.image)]"
                    ".filter(x, x).size() == 1",
            "message": "model.source must set exactly one of huggingFace, pvc, image"}]},
    )
    return _obj({
        "name": {"type": "string", "minLength": 1, "maxLength": 253,
                 "description": "Served model name (what clients send as `model`)."},
        "source": source,
    }, required=["name"])


def engine_schema() -> Schema:
    env_var = _obj({"name": {"type": "string", "minLength": 1}, "value": {"type": "string"},
                    "valueFrom": _free_object("EnvVarSource")}, required=["name"])
    return _obj(
        {
            "kind": {"type": "string", "enum": list(ENGINE_KINDS), "default": "sluice"},
            "image": {"type": "string",
                      "description": "Engine image; the operator's default for the kind."},
            "blockSize": {"type": "integer", "enum": [8, 16, 32, 64, 128], "default": 16},
            "maxNumSeqs": {"type": "integer", "minimum": 1, "maximum": 4096, "default": 256},
            "maxNumBatchedTokens": {"type": "integer", "minimum": 16, "default": 2048},
            "maxModelLen": {"type": "integer", "minimum": 16},
            "gpuMemoryUtilization": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                     "maximum": 1},
            "kvCacheMemory": {"type": "string", "pattern": r"^[0-9]+(KiB|MiB|GiB)$",
                              "description": "CPU KV cache size (sluice engine only)."},
            "dtype": {"type": "string", "enum": list(DTYPES), "default": "auto"},
            "prefixCaching": {"type": "boolean", "default": True},
            "args": {"type": "array", "items": {"type": "string"}},
            "env": {"type": "array", "items": env_var},
        },
        default={},
        **{"x-kubernetes-validations": [{
            "rule": "self.kind == 'sluice' || !has(self.kvCacheMemory)",
            "message": "engine.kvCacheMemory is only for kind sluice"}]},
    )


def spec_schema() -> Schema:
    name_ref = _obj({"name": {"type": "string", "minLength": 1}}, required=["name"])
    return _obj(
        {
            "model": model_schema(),
            "engine": engine_schema(),
            "replicas": {"type": "integer", "minimum": 0, "maximum": 1000},
            "roles": _obj({"prefill": role_schema(), "decode": role_schema()},
                          required=["prefill", "decode"],
                          description="Disaggregated pool: prefill and decode replicas."),
            "resources": resources_schema(),
            "autoscaling": autoscaling_schema(),
            "modelCache": _obj({"sizeLimit": {"type": "string", "default": "20Gi"},
                                "claimName": {"type": "string"}}, default={}),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": _free_object("Toleration")},
            "affinity": _free_object("Affinity"),
            "priorityClassName": {"type": "string"},
            "imagePullSecrets": {"type": "array", "items": name_ref},
            "serviceAccountName": {"type": "string"},
        },
        required=["model"],
        **{"x-kubernetes-validations": [
            {"rule": "has(self.replicas) != has(self.roles)",
             "message": "set exactly one of spec.replicas (plain pool) or spec.roles "
                        "(prefill/decode pool)"},
            {"rule": "has(self.model.source) || self.engine.kind == 'sluice'",
             "message": "engine kind vllm needs spec.model.source"},
            {"rule": "!has(self.roles) || !has(self.autoscaling) || "
                     "!self.autoscaling.enabled",
             "message": "a prefill/decode pool autoscales per role "
                        "(spec.roles.<role>.autoscaling), not with spec.autoscaling"},
        ]},
    )


def status_schema() -> Schema:
    condition = _obj({
        "type": {"type": "string"}, "status": {"type": "string"},
        "reason": {"type": "string"}, "message": {"type": "string"},
        "observedGeneration": {"type": "integer"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
    }, required=["type", "status"])
    counts = _obj({"replicas": {"type": "integer"}, "readyReplicas": {"type": "integer"}})
    endpoint = _obj({"pod": {"type": "string"}, "role": {"type": "string"},
                     "ip": {"type": "string"}, "url": {"type": "string"},
                     "kvEvents": {"type": "string"}, "ready": {"type": "boolean"}})
    return _obj({
        "observedGeneration": {"type": "integer"},
        "replicas": {"type": "integer"},
        "readyReplicas": {"type": "integer"},
        "selector": {"type": "string"},
        "roles": {"type": "object", "additionalProperties": counts},
        "conditions": {"type": "array", "items": condition,
                       "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "endpoints": {"type": "array", "items": endpoint},
        "kvCacheUsage": {"type": "number"},
        "queueDepth": {"type": "number"},
        "lastScaleTime": {"type": "string", "format": "date-time"},
    })
