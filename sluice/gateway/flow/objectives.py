"""A request's priority and fairness id, as llm-d and GIE give them.

Priority: the InferenceObjective the request names in `x-llm-d-inference-objective` (or
GIE's `x-gateway-inference-objective`) gives its priority, as a `--objective` does
here. Without one: the objective configured for its API key, else for its model, else
priority 0. An objective name no `--objective` defines counts as none (priority 0), so a
client cannot invent priorities, and the priorities (a metrics label) stay few. A key's
own objective wins over the header: a tenant cannot raise itself above what its key
was given.

Fairness id (the tenant whose share flow control keeps fair within a priority): the
`x-llm-d-inference-fairness-id` (or `x-gateway-inference-fairness-id`) header, else the
API key's name, else GIE's `default-flow`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DEFAULT_FLOW = "default-flow"
MAX_FAIRNESS_ID = 256  # longer ids are cut (they key a bounded table of queues)


@dataclass(frozen=True)
class Objective:
    name: str
    priority: int
    models: tuple[str, ...] = ()  # requests for these models get it by default
    keys: tuple[str, ...] = ()    # requests with these API keys (by name) always get it


def parse_objective(spec: str) -> Objective:
    """`NAME=PRIORITY[,models=A|B][,keys=K1|K2]` (ValueError naming what is wrong)."""
    head, *opts = spec.split(",")
    name, sep, prio = head.partition("=")
    try:
        priority = int(prio)
    except ValueError:
        priority = None
    if not sep or not name or priority is None:
        raise ValueError(f"objective {spec!r}: NAME=PRIORITY (an integer) first")
    lists: dict[str, tuple[str, ...]] = {}
    for opt in opts:
        k, sep, v = opt.partition("=")
        if k not in ("models", "keys") or not sep or not v:
            raise ValueError(f"objective {spec!r}: options are models=A|B and keys=K1|K2")
        lists[k] = tuple(x for x in v.split("|") if x)
    return Objective(name, priority, lists.get("models", ()), lists.get("keys", ()))


@dataclass(frozen=True)
class Objectives:
    by_name: Mapping[str, Objective] = field(default_factory=dict)

    @classmethod
    def from_specs(cls, specs: list[str]) -> Objectives:
        objectives = [parse_objective(s) for s in specs]
        names = [o.name for o in objectives]
        if len(set(names)) != len(names):
            raise ValueError(f"an objective is defined twice: {names}")
        return cls({o.name: o for o in objectives})

    def __post_init__(self) -> None:
        by_model: dict[str, Objective] = {}
        by_key: dict[str, Objective] = {}
        for o in self.by_name.values():
            for table, names in ((by_model, o.models), (by_key, o.keys)):
                for n in names:
                    if n in table:
                        raise ValueError(f"{n!r} is given two objectives: {table[n].name}, "
                                         f"{o.name}")
                    table[n] = o
        object.__setattr__(self, "_by_model", by_model)
        object.__setattr__(self, "_by_key", by_key)

    def priority(self, model: str, api_key: str | None, headers: Mapping[str, str]) -> int:
        """The request's priority (see the module docstring)."""
        o = self._by_key.get(api_key) if api_key is not None else None
        if o is None:
            named = next((headers[h] for h in OBJECTIVE_HEADERS if h in headers), None)
            o = self.by_name.get(named) if named else None
        if o is None:
            o = self._by_model.get(model)
        return o.priority if o is not None else 0


def fairness_id(api_key: str | None, headers: Mapping[str, str]) -> str:
    got = next((headers[h] for h in FAIRNESS_HEADERS if headers.get(h)), None)
    return (got or api_key or DEFAULT_FLOW)[:MAX_FAIRNESS_ID]
