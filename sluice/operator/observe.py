"""Read what a pool's children look like now, and what is wrong that only the operator
can see (missing PVC or Secret, unschedulable GPU request, failing images or engines, a
Deployment whose pods the API server refuses or whose rollout stalled).

Missing Secrets are detected from the pods' waiting reasons rather than by reading
Secrets, so the operator needs no access to Secrets at all (least privilege).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice import labels
from sluice.operator import kube
from sluice.operator.render import child_name
from sluice.operator.sources import PvcSource
from sluice.operator.spec import PoolSpec

Problem = tuple[str, str]  # (reason, message) for the Degraded condition

_WAITING_REASONS = {
    "CreateContainerConfigError": "MissingSecret",  # e.g. secret "hf-token" not found
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed",
    "CrashLoopBackOff": "EngineCrashLooping",
}


@dataclass(frozen=True)
class Observed:
    deployments: dict[str, dict[str, Any]]  # role -> live Deployment (absent: missing)
    pods: list[dict[str, Any]]
    problems: list[Problem] = field(default_factory=list)


# Deployment conditions that mean its pods will not come by themselves: the ReplicaSet
# controller's pod creates refused (quota, Pod Security, a bad quantity), or no progress
# within progressDeadlineSeconds (600 s by default).
_DEPLOYMENT_CONDITIONS = {
    ("ReplicaFailure", "True"): "ReplicaFailure",
    ("Progressing", "False"): "RolloutStalled",
}


def deployment_problems(deployments: dict[str, dict[str, Any]]) -> list[Problem]:
    """Pure: a problem per failing Deployment condition, with the controller's message."""
    found = []
    for dep in deployments.values():
        name = dep["metadata"]["name"]
        for cond in (dep.get("status") or {}).get("conditions") or ():
            reason = _DEPLOYMENT_CONDITIONS.get((cond.get("type"), cond.get("status")))
            if reason:
                detail = cond.get("message") or cond.get("reason") or cond["type"]
                found.append((reason, f"Deployment {name}: {cond.get('reason', '')}: {detail}"))
    return found


def pod_problems(pods: list[dict[str, Any]]) -> list[Problem]:
    """Pure: the first problem of each kind across the pool's pods."""
    found: dict[str, str] = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cond in status.get("conditions") or ():
            if (cond.get("type") == "PodScheduled" and cond.get("status") == "False"
                    and cond.get("reason") == "Unschedulable"):
                found.setdefault("Unschedulable", f"pod {name}: {cond.get('message', '')}")
        statuses = (status.get("initContainerStatuses") or []) + (
            status.get("containerStatuses") or [])
        for cs in statuses:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = _WAITING_REASONS.get(waiting.get("reason", ""))
            if reason:
                found.setdefault(reason, f"pod {name}: {waiting.get('message') or waiting['reason']}")
    return sorted(found.items())


def endpoints(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pure: the engines the gateway can route to, one per pod with an IP."""
    out = []
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (pod.get("status") or {}).get("conditions") or ())
        out.append({"pod": pod["metadata"]["name"],
                    "role": pod["metadata"].get("labels", {}).get(labels.ROLE, ""),
                    "ip": ip, "url": f"http://{ip}:{labels.HTTP_PORT}",
                    "kvEvents": f"tcp://{ip}:{labels.KV_EVENTS_PORT}", "ready": ready})
    return sorted(out, key=lambda e: e["pod"])


async def observe(client: kube.KubeClient, pool: PoolSpec,
                  known: dict[str, dict[str, Any]] | None = None) -> Observed:
    """`known`: children just read or written ("Kind/name" -> object), not fetched again."""
    deployments = {}
    for role in pool.roles:
        name = child_name(pool.name, role.name)
        if known and f"Deployment/{name}" in known:
            deployments[role.name] = known[f"Deployment/{name}"]
            continue
        try:
            deployments[role.name] = await client.get(
                kube.DEPLOYMENTS, pool.namespace, child_name(pool.name, role.name))
        except kube.NotFound:
            pass
    pods = await client.list(kube.PODS, pool.namespace, labels.pool_selector(pool.name))
    problems: list[Problem] = []
    claims = [pool.cache_claim] if pool.cache_claim else []
    if isinstance(pool.source, PvcSource):
        claims.append(pool.source.claim_name)
    for claim in claims:
        try:
            await client.get(kube.PVCS, pool.namespace, claim)
        except kube.NotFound:
            problems.append(("MissingPVC",
                             f"PersistentVolumeClaim {pool.namespace}/{claim} not found"))
    return Observed(deployments, pods,
                    problems + deployment_problems(deployments) + pod_problems(pods))
