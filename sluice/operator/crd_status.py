"""OpenAPI v3 schema of the InferencePool status (written by the operator only), every
field described for `kubectl explain spool.status`.

`replicas` and `selector` are what the scale subresource reports (an HPA counts the pods
the selector matches against `replicas`), so they always describe the same pods: the
`serve` engines of a plain pool, every engine of a prefill/decode pool. `roles.<role>`
carries the same pair per role.
"""

from __future__ import annotations

from sluice.operator.crd_types import Schema, obj, prop


def status_schema() -> Schema:
    condition = obj("A condition: Ready, Progressing or Degraded.", {
        "type": prop("string", "Ready, Progressing or Degraded."),
        "status": prop("string", "True, False or Unknown."),
        "reason": prop("string", "CamelCase cause, e.g. ChildRejected, ReplicaFailure, "
                         "MissingPVC, Unschedulable."),
        "message": prop("string", "What is wrong, in words (the API server's or the "
                          "scheduler's own message where there is one)."),
        "observedGeneration": prop("integer", "The spec generation it describes."),
        "lastTransitionTime": prop("string", "When status last changed.",
                                     format="date-time"),
    }, required=["type", "status"])
    counts = obj("Engines of one role.", {
        "replicas": prop("integer", "Engines of the role (its Deployment's status)."),
        "readyReplicas": prop("integer", "Of which ready."),
        "selector": prop("string", "Label selector of exactly these engines' pods."),
    })
    endpoint = obj("An engine pod the gateway can route to.", {
        "pod": prop("string", "Pod name."),
        "role": prop("string", "serve, prefill or decode."),
        "ip": prop("string", "Pod IP."),
        "url": prop("string", "The engine's HTTP base URL."),
        "kvEvents": prop("string", "The engine's KV-event socket (ZMQ)."),
        "ready": prop("boolean", "Whether the pod is Ready."),
    })
    adapter = obj("A LoRA adapter of spec.loras.", {
        "name": prop("string", "The adapter's name."),
        "readyReplicas": prop("integer", "Ready engines that list it in /v1/models."),
    })
    return obj("Observed state, written by the operator.", {
        "observedGeneration": prop("integer", "The spec generation last reconciled."),
        "replicas": prop("integer", "Engines that `selector` selects: the serve engines "
                           "(plain pool) or all roles' (prefill/decode pool)."),
        "readyReplicas": prop("integer", "Of which ready."),
        "selector": prop("string", "Label selector of the pods `replicas` counts (the "
                           "scale subresource's, for an HPA)."),
        "roles": {"type": "object", "description": "Per role (serve, or prefill and decode).",
                  "additionalProperties": counts},
        "conditions": prop("array", "Ready, Progressing, Degraded.", items=condition,
                             **{"x-kubernetes-list-type": "map",
                                "x-kubernetes-list-map-keys": ["type"]}),
        "endpoints": prop("array", "The engine pods with an IP.", items=endpoint),
        "kvCacheUsage": prop("number", "Mean KV cache usage (0-1) at the last autoscaler "
                               "sample (of the decode engines in a prefill/decode pool)."),
        "queueDepth": prop("number", "Mean waiting requests per engine at that sample (of "
                             "the prefill engines in a prefill/decode pool)."),
        "lastScaleTime": prop("string", "When the autoscaler last changed replicas.",
                                format="date-time"),
        "loras": prop("array", "Per adapter of spec.loras, the engines serving it.",
                      items=adapter),
    })
