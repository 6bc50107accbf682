"""Pure status computation: (spec, observed children, problems) → the pool's status.

Conditions follow the Kubernetes convention: `Ready`, `Progressing`, `Degraded`, each
with a CamelCase reason and a human message; `lastTransitionTime` changes only when
a condition's status flips. `kvCacheUsage`, `queueDepth` and `lastScaleTime` belong to
the autoscaler and are carried over unchanged.

`replicas` and `selector` describe the same pods (the scale subresource hands both to an
HPA): the `serve` engines of a plain pool, every role's of a prefill/decode pool (whose
scale subresource `spec.replicas` does not apply: its roles scale apart). Each
`roles.<role>` has its own replicas and selector.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice import labels
from sluice.operator.observe import Observed, Problem, endpoints
from sluice.operator.spec import PoolSpec

AUTOSCALER_FIELDS = ("kvCacheUsage", "queueDepth", "lastScaleTime")


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int,
               previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    since = previous.get("lastTransitionTime") if previous and previous.get(
        "status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since or now}


def selector(pool: str, role: str | None = None) -> str:
    """Label selector string of a pool's engine pods (of one role, when given)."""
    return f"{labels.POOL}={pool}" + (f",{labels.ROLE}={role}" if role else "")


def _role_counts(dep: Mapping[str, Any] | None, generation_ok: bool) -> dict[str, int | bool]:
    status = (dep or {}).get("status") or {}
    spec_replicas = int(((dep or {}).get("spec") or {}).get("replicas") or 0)
    rolled_out = (dep is not None and generation_ok
                  and int(status.get("observedGeneration") or 0)
                  >= int(dep.get("metadata", {}).get("generation") or 0)
                  and int(status.get("updatedReplicas") or 0) >= spec_replicas)
    return {"replicas": int(status.get("replicas") or 0),
            "readyReplicas": int(status.get("readyReplicas") or 0),
            "rolledOut": rolled_out}


def compute_status(pool: PoolSpec, observed: Observed, problems: list[Problem],
                   previous: Mapping[str, Any] | None, now: str,
                   loras: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`loras`: status.loras as `lora.LoraSyncer` found it; None: LoRA is off (no field)."""
    previous = previous or {}
    prev_conditions = {c["type"]: c for c in previous.get("conditions") or ()}
    roles: dict[str, dict[str, Any]] = {}
    progressing: list[str] = []
    not_ready: list[str] = []
    for role in pool.roles:
        dep = observed.deployments.get(role.name)
        counts = _role_counts(dep, True)
        roles[role.name] = {"replicas": int(counts["replicas"]),
                            "readyReplicas": int(counts["readyReplicas"]),
                            "selector": selector(pool.name, role.name)}
        if dep is None:
            progressing.append(f"{role.name}: Deployment missing")
        elif not counts["rolledOut"]:
            progressing.append(f"{role.name}: rolling out")
        if int(counts["readyReplicas"]) < role.replicas:
            not_ready.append(f"{role.name}: {counts['readyReplicas']}/{role.replicas} ready")
    replicas = sum(r["replicas"] for r in roles.values())
    ready = sum(r["readyReplicas"] for r in roles.values())
    desired = sum(role.replicas for role in pool.roles)

    g = pool.generation
    degraded = _condition(
        "Degraded", bool(problems), problems[0][0] if problems else "AsExpected",
        "; ".join(m for _, m in problems) if problems else "no problems detected",
        g, prev_conditions.get("Degraded"), now)
    progress = _condition(
        "Progressing", bool(progressing or not_ready),
        "RollingOut" if progressing else ("WaitingForReplicas" if not_ready else "Stable"),
        "; ".join(progressing + not_ready) or f"{ready}/{desired} replicas ready",
        g, prev_conditions.get("Progressing"), now)
    is_ready = not not_ready and not progressing and not problems
    ready_reason = ("ScaledToZero" if is_ready and desired == 0 else
                    "AllReplicasReady" if is_ready else
                    "Degraded" if problems else "ReplicasNotReady")
    ready_cond = _condition("Ready", is_ready, ready_reason,
                            f"{ready}/{desired} replicas ready", g,
                            prev_conditions.get("Ready"), now)

    status: dict[str, Any] = {
        "observedGeneration": g,
        "replicas": replicas,  # summed over the roles: the pods `selector` matches
        "readyReplicas": ready,
        "selector": (selector(pool.name) if pool.disaggregated
                     else selector(pool.name, pool.roles[0].name)),
        "roles": roles,
        "conditions": [ready_cond, progress, degraded],
        "endpoints": endpoints(observed.pods),
    }
    if loras is not None:
        status["loras"] = loras
    for key in AUTOSCALER_FIELDS:
        if key in previous:
            status[key] = previous[key]
    return status


def invalid_spec_status(generation: int, message: str, previous: Mapping[str, Any] | None,
                        now: str) -> dict[str, Any]:
    """Status for a spec the operator cannot render (it leaves existing children alone)."""
    prev = {c["type"]: c for c in (previous or {}).get("conditions") or ()}
    status = dict(previous or {})
    status.update({"observedGeneration": generation, "conditions": [
        _condition("Ready", False, "InvalidSpec", message, generation, prev.get("Ready"), now),
        _condition("Progressing", False, "InvalidSpec", message, generation,
                   prev.get("Progressing"), now),
        _condition("Degraded", True, "InvalidSpec", message, generation,
                   prev.get("Degraded"), now)]})
    return status


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal up to condition timestamps (avoid writes that change nothing)."""
    def strip(s: Mapping[str, Any] | None) -> dict[str, Any]:
        s = dict(s or {})
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in s.get("conditions") or ()]
        return s
    return strip(a) == strip(b)
