"""Plugin types by name, as GIE's `plugins/registry.go` and llm-d's `register.go` keep them.

A plugin type is registered with `@plugin("type-name", Params)`: `Params` is a frozen
dataclass whose snake_case fields are the type's parameters, written camelCase in an
EndpointPickerConfig (`hashBlockSize` -> `hash_block_size`), each with its default.
`build` checks the parameters: an unknown type or parameter, or a value of the wrong
type, is a `PluginError` that names it and lists the known ones. Parameters that llm-d
or GIE define for plugins whose work Sluice does elsewhere are accepted and listed in
`Params.IGNORED` (documented per plugin), so their sample files load unchanged.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sluice.gateway.routing.plugin_context import PluginContext


class PluginError(ValueError):
    """A configuration that names an unknown plugin type or parameter, or a bad value."""


@dataclass(frozen=True)
class NoParams:
    """A plugin type without parameters."""


@dataclass(frozen=True)
class PluginType:
    name: str
    factory: Callable[[str, Any, PluginContext], Any]  # (instance name, params, context)
    params: type
    doc: str

    def keys(self) -> dict[str, str]:
        """{parameter name as written: its field}: camelCase, or `Params.NAMES`' own
        spelling (`speculativeTTL`)."""
        names = dict(getattr(self.params, "NAMES", ()))
        return {names.get(f.name, camel(f.name)): f.name
                for f in dataclasses.fields(self.params)}

    def known(self) -> list[str]:
        return sorted([*self.keys(), *getattr(self.params, "IGNORED", ())])


TYPES: dict[str, PluginType] = {}
ALIASES: dict[str, str] = {}  # an older or other project's type name -> ours


def plugin(type_name: str, params: type = NoParams, aliases: tuple[str, ...] = ()):
    """Register the decorated class (built as `cls(name, params, ctx)`) as `type_name`."""
    assert dataclasses.is_dataclass(params), params

    def register(cls):
        assert type_name not in TYPES, f"plugin type {type_name!r} registered twice"
        cls.type = type_name
        TYPES[type_name] = PluginType(type_name, cls, params, (cls.__doc__ or "").strip())
        for alias in aliases:
            ALIASES[alias] = type_name
        return cls
    return register


def check_keys(what: str, value: Any, known: tuple[str, ...]) -> None:
    """`value` is a mapping of `known` keys only; else a PluginError naming the others."""
    if not isinstance(value, Mapping):
        raise PluginError(f"{what} must be a mapping, not {value!r}")
    if unknown := [k for k in value if k not in known]:
        raise PluginError(f"{what} has unknown field(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(known)}")


def camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def lookup(type_name: str) -> PluginType:
    from sluice.gateway.routing import catalog  # noqa: F401 -- registers every type
    t = TYPES.get(ALIASES.get(type_name, type_name))
    if t is None:
        raise PluginError(f"unknown plugin type {type_name!r}; known types: "
                          + ", ".join(sorted(TYPES)))
    return t


def build(type_name: str, name: str, raw: Mapping[str, Any] | None, ctx: PluginContext):
    """An instance of `type_name` named `name`, its parameters checked."""
    t = lookup(type_name)
    return t.factory(name, parse_params(t, raw or {}), ctx)


def parse_params(t: PluginType, raw: Mapping[str, Any]):
    if not isinstance(raw, Mapping):
        raise PluginError(f"plugin type {t.name!r}: parameters must be a mapping")
    fields = t.keys()
    hints = typing.get_type_hints(t.params)
    ignored = set(getattr(t.params, "IGNORED", ()))
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ignored:
            continue
        field = fields.get(key)
        if field is None:
            raise PluginError(f"plugin type {t.name!r} has no parameter {key!r}; known: "
                              + (", ".join(t.known()) or "none"))
        kwargs[field] = _coerce(t.name, key, value, hints[field])
    try:
        return t.params(**kwargs)
    except (AssertionError, ValueError, TypeError) as err:
        raise PluginError(f"plugin type {t.name!r}: bad parameters {dict(raw)!r}: "
                          f"{err or 'out of range'}") from err


def _coerce(type_name: str, key: str, value: Any, hint: Any) -> Any:
    """`value` as the field's type: YAML gives ints where floats are meant, and
    strings or lists where tuples are stored."""
    want = hint
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        want = next(a for a in args if a is not type(None))
    origin = typing.get_origin(want)
    ok = True
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want is bool:
        ok = isinstance(value, bool)
    elif want is str:
        ok = isinstance(value, str)
    elif origin is tuple:
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    elif origin is dict or want is dict:
        ok = isinstance(value, Mapping)
        value = dict(value) if ok else value
    if not ok:
        raise PluginError(f"plugin type {type_name!r}: parameter {key!r} must be "
                          f"{getattr(want, '__name__', want)}, not {value!r}")
    return value
