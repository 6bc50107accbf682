"""What the API server does with a custom resource before storing it, for tests:
structural defaulting, OpenAPI v3 validation and CEL rules (`x-kubernetes-validations`).

Validation uses `jsonschema` (Draft 4 semantics, as Kubernetes' boolean
`exclusiveMinimum`) and CEL rules are evaluated with `celpy` (PyPI `cel-python`) on
the defaulted object, like the API server. Errors read like the API server's:
`spec.replicas: <message>`.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

Schema = dict[str, Any]


def crd_schema(crd: dict[str, Any], version: str | None = None) -> Schema:
    for v in crd["spec"]["versions"]:
        if version is None or v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def apply_defaults(schema: Schema, obj: Any) -> Any:
    """Structural defaulting: fill `default`s of absent properties, recursively."""
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    return obj


def _default(schema: Schema, obj: Any) -> None:
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                _default(sub, obj[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                if key not in (schema.get("properties") or {}):
                    _default(extra, value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default(schema["items"], item)


_CEL_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _cel(rule: str, value: Any) -> bool:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _CEL_ENV.program(_CEL_ENV.compile(rule))
    result = _PROGRAMS[rule].evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, Exception):
        raise result
    return bool(result)


def _cel_errors(schema: Schema, obj: Any, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations") or ():
        if not _cel(rule["rule"], obj):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in obj:
                errors += _cel_errors(sub, obj[key], f"{path}.{key}".lstrip("."))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def validate(schema: Schema, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default then validate `obj`; returns (defaulted object, error messages)."""
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(schema)
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
              for e in sorted(validator.iter_errors(defaulted), key=lambda e: list(e.path))]
    if not errors:  # the API server runs CEL only on schema-valid objects
        errors = _cel_errors(schema, defaulted, "")
    return defaulted, errors
