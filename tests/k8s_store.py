"""The storage semantics of a Kubernetes API server, in memory, for the emulator.

What kmock's emulator lacks and this adds: `resourceVersion` (one global counter),
`uid`, `generation` (bumped only when the spec changes), `creationTimestamp`, status
and scale subresources (writes to the main resource ignore `status`, writes to
`/status` change only `status`), optimistic concurrency (409 on a stale
`resourceVersion`), AlreadyExists, finalizers with `deletionTimestamp`, background
garbage collection by ownerReferences, label selectors, and an event log that
watches replay from a `resourceVersion`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonpatch

Obj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message
        self.details = details


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    # scale subresource paths: (spec replicas, status replicas, status selector)
    scale: tuple[str, str, str] | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


@dataclass
class Event:
    rv: int
    type: str
    kind: Kind
    obj: Obj


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _requirement(expr: str) -> Callable[[dict[str, str]], bool]:
    """One requirement of a label selector as a predicate on a label dict."""
    expr = expr.strip()
    for op in (" notin ", " in "):
        if op in expr:
            raw_key, values = expr.split(op, 1)
            key = raw_key.strip()
            allowed = {v.strip() for v in values.strip().strip("()").split(",")}
            if op == " notin ":
                return lambda ls: ls.get(key) not in allowed
            return lambda ls: key in ls and ls[key] in allowed
    if "!=" in expr:
        key, value = (part.strip() for part in expr.split("!=", 1))
        return lambda ls: ls.get(key) != value
    if "=" in expr:
        key, value = (part.strip() for part in expr.replace("==", "=").split("=", 1))
        return lambda ls: ls.get(key) == value
    if expr.startswith("!"):
        absent = expr[1:].strip()
        return lambda ls: absent not in ls
    return lambda ls: expr in ls


def selector_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Kubernetes label selector syntax: `a=b,c!=d,e in (f,g),h,!i`."""
    if not selector:
        return True
    return all(req(labels) for req in _parse_selector(selector))


@functools.lru_cache(maxsize=1024)
def _parse_selector(selector: str) -> tuple[Callable[[dict[str, str]], bool], ...]:
    parts, depth, cur = [], 0, ""
    for ch in selector:  # split on commas outside parentheses
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return tuple(_requirement(p) for p in parts if p.strip())


def _get(obj: Obj, path: str) -> Any:
    for key in path.strip(".").split("."):
        obj = (obj or {}).get(key)
    return obj


def _set(obj: Obj, path: str, value: Any) -> None:
    keys = path.strip(".").split(".")
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    obj[keys[-1]] = value


def _essence(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@dataclass
class Store:
    # hook per plural: obj -> (defaulted obj, error messages), like CRD schemas
    validators: dict[str, Callable[[Obj], tuple[Obj, list[str]]]] = field(default_factory=dict)
    objects: dict[tuple[str, str | None, str], Obj] = field(default_factory=dict)
    by_kind: dict[str, dict[tuple[str, str | None, str], Obj]] = field(default_factory=dict)
    log: list[Event] = field(default_factory=list)
    _rv: itertools.count = field(default_factory=lambda: itertools.count(1))
    rv: int = 0

    def _bump(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _emit(self, type_: str, kind: Kind, obj: Obj) -> None:
        self.log.append(Event(self.rv, type_, kind, copy.deepcopy(obj)))

    def key(self, kind: Kind, ns: str | None, name: str) -> tuple[str, str | None, str]:
        return (f"{kind.group}/{kind.plural}", ns if kind.namespaced else None, name)

    def get(self, kind: Kind, ns: str | None, name: str) -> Obj:
        obj = self.objects.get(self.key(kind, ns, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{kind.plural}.{kind.group} "{name}" not found')
        return obj

    def list(self, kind: Kind, ns: str | None, selector: str | None = None) -> list[Obj]:
        objs = self.by_kind.get(f"{kind.group}/{kind.plural}", {})
        return [copy.deepcopy(o) for (_, o_ns, _), o in sorted(objs.items(),
                                                                key=lambda kv: str(kv[0]))
                if (ns is None or o_ns == ns)
                and selector_matches(selector, o["metadata"].get("labels") or {})]

    def _put(self, key: tuple[str, str | None, str], obj: Obj | None) -> None:
        kind_objs = self.by_kind.setdefault(key[0], {})
        if obj is None:
            del self.objects[key], kind_objs[key]
        else:
            self.objects[key] = kind_objs[key] = obj

    def _validate(self, kind: Kind, obj: Obj) -> Obj:
        check = self.validators.get(kind.plural)
        if check is None:
            return obj
        defaulted, errors = check(obj)
        if errors:
            name = obj.get("metadata", {}).get("name")
            causes = [{"reason": "FieldValueInvalid", "field": e.split(": ", 1)[0],
                       "message": e.split(": ", 1)[-1]} for e in errors]
            raise ApiError(422, "Invalid", f'{kind.kind}.{kind.group} "{name}" is invalid: '
                           + "; ".join(errors), {"name": name, "group": kind.group,
                                                 "kind": kind.kind, "causes": causes})
        return defaulted

    def create(self, kind: Kind, ns: str | None, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        generated = not meta.get("name")
        if generated and not meta.get("generateName"):
            raise ApiError(422, "Invalid", "metadata.name or generateName is required")
        while generated and (not meta.get("name") or self.key(
                kind, ns or meta.get("namespace"), meta["name"]) in self.objects):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]  # retried if taken
        if kind.namespaced:
            meta["namespace"] = ns or meta.get("namespace") or "default"
        key = self.key(kind, meta.get("namespace"), meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists",
                           f'{kind.plural}.{kind.group} "{meta["name"]}" already exists')
        if "status" in kind.subresources:
            obj.pop("status", None)
        obj = self._validate(kind, obj)
        obj.update(apiVersion=kind.api_version, kind=kind.kind)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), generation=1, resourceVersion=self._bump(),
                    creationTimestamp=datetime.datetime.now(datetime.UTC).strftime(
                        "%Y-%m-%dT%H:%M:%SZ"))
        self._put(key, obj)
        self._emit("ADDED", kind, obj)
        refs = meta.get("ownerReferences") or ()
        if refs and not any(self._exists(r.get("uid")) for r in refs):
            # the garbage collector deletes a dependent whose owners are all gone, also
            # one created after they went (a controller's pass that raced the deletion)
            self.delete(kind, meta.get("namespace"), meta["name"])
        return copy.deepcopy(obj)

    def _exists(self, uid: str | None) -> bool:
        return any(o["metadata"].get("uid") == uid for o in self.objects.values())

    def write(self, kind: Kind, ns: str | None, name: str, subresource: str | None,
              new: Obj, expected_rv: str | None) -> Obj:
        """Store `new` (a full object) as the next version, with API-server rules."""
        old = self.get(kind, ns, name)
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind.plural}'
                           f'.{kind.group} "{name}": the object has been modified; please '
                           "apply your changes to the latest version and try again")
        new = copy.deepcopy(new)
        if subresource == "status":
            new = {**copy.deepcopy(old), "status": new.get("status")}
        elif subresource == "scale":
            replicas = (new.get("spec") or {}).get("replicas")
            new = copy.deepcopy(old)
            _set(new, kind.scale[0] if kind.scale else "spec.replicas", replicas)
        elif "status" in kind.subresources:
            new["status"] = copy.deepcopy(old.get("status"))
            if new["status"] is None:
                new.pop("status")
        meta = new.setdefault("metadata", {})
        for immutable in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if immutable in old["metadata"]:
                meta[immutable] = old["metadata"][immutable]
        new.update(apiVersion=kind.api_version, kind=kind.kind)
        if subresource != "status":
            new = self._validate(kind, new)
            meta = new["metadata"]
        meta["generation"] = old["metadata"]["generation"] + (
            _essence(new) != _essence(old))
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return copy.deepcopy(old)  # no-op writes keep the resourceVersion
        meta["resourceVersion"] = self._bump()
        self._put(self.key(kind, ns, name), new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(kind, new)
        self._emit("MODIFIED", kind, new)
        return copy.deepcopy(new)

    def patch(self, kind: Kind, ns: str | None, name: str, subresource: str | None,
              patch: Any, content_type: str) -> Obj:
        old = self.get(kind, ns, name)
        if subresource == "scale":
            return self.write(kind, ns, name, "scale", patch, None)
        if "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(old, patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                # e.g. a failed `test` of metadata.resourceVersion (kopf's optimistic lock)
                raise ApiError(422, "Invalid", f"the JSON patch was rejected: {e}") from e
            rv = None
        else:  # merge and strategic merge (treated as merge: lists are replaced)
            new = merge_patch(old, patch)
            rv = (patch.get("metadata") or {}).get("resourceVersion")
        return self.write(kind, ns, name, subresource, new, rv)

    def scale(self, kind: Kind, obj: Obj) -> Obj:
        spec_path, status_path, selector_path = kind.scale or ("spec.replicas", "", "")
        status = {"replicas": _get(obj, status_path) or 0}
        if _get(obj, selector_path):
            status["selector"] = _get(obj, selector_path)
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: obj["metadata"][k] for k in
                             ("name", "namespace", "uid", "resourceVersion") if k in obj["metadata"]},
                "spec": {"replicas": _get(obj, spec_path) or 0}, "status": status}

    def delete(self, kind: Kind, ns: str | None, name: str) -> Obj:
        obj = self.get(kind, ns, name)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = datetime.datetime.now(datetime.UTC).strftime(
                    "%Y-%m-%dT%H:%M:%SZ")
                meta["resourceVersion"] = self._bump()
                self._emit("MODIFIED", kind, obj)
            return copy.deepcopy(obj)
        return self._remove(kind, obj)

    def _remove(self, kind: Kind, obj: Obj) -> Obj:
        meta = obj["metadata"]
        self._put(self.key(kind, meta.get("namespace"), meta["name"]), None)
        self._bump()
        self._emit("DELETED", kind, obj)
        self.collect_garbage(meta["uid"])
        return copy.deepcopy(obj)

    kinds: dict[str, Kind] = field(default_factory=dict)  # "group/plural" -> Kind

    def collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion of the dependents of a deleted owner."""
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or ()
            if any(r.get("uid") == owner_uid for r in refs) and key in self.objects:
                kind = self.kinds[key[0]]
                self.delete(kind, key[1], key[2])
