"""Building blocks of the InferencePool CRD's OpenAPI v3 schema (`crd_schema`, `crd_lora`,
`crd_status`): objects with their defaults, described fields, CEL rules, quantities."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# A Kubernetes resource.Quantity, not negative: digits with an optional fraction, then a
# binary (Ki … Ei), decimal (n u m k M G T P E) or exponent (e3) suffix. What the API server
# would otherwise refuse only later, on the Deployment, with the pool left half applied.
QUANTITY_PATTERN = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
PERCENT_PATTERN = r"^[0-9]+%$"


def obj(description: str, properties: Schema, required: list[str] | None = None,
         defaulted: bool = False, **extra: Any) -> Schema:
    """An object schema. `defaulted`: an absent object defaults to its fields' defaults.

    That default is spelled out rather than `{}`: the API server checks a default against
    the object's CEL rules before the nested defaults fill it, so `{}` fails every rule
    that reads a defaulted field ("no such key")."""
    schema: Schema = {"type": "object", "description": description, "properties": properties,
                      **extra}
    if required:
        schema["required"] = required
    if defaulted:
        schema["default"] = {k: v["default"] for k, v in properties.items() if "default" in v}
    return schema


def prop(type_: str, description: str, **extra: Any) -> Schema:
    return {"type": type_, "description": description, **extra}


def free_object(description: str) -> Schema:
    """A Kubernetes type we pass through to the pod as is (validated by the API server there)."""
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
            "description": description}


def cel(rule: str, message: str) -> Schema:
    """A CEL rule and the message `kubectl apply` shows when it fails."""
    return {"rule": rule, "message": message}


def rules(*rules: Schema) -> Schema:
    return {"x-kubernetes-validations": list(rules)}


def quantity(description: str, **extra: Any) -> Schema:
    return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN, "minimum": 0, "description": description, **extra}


def int_or_percent(description: str, **extra: Any) -> Schema:
    return {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": PERCENT_PATTERN, "minimum": 0, "description": description, **extra}
