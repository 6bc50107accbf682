"""GIE mode: an endpoint picker of its own per pool (`<pool>-epp`), as GIE and llm-d deploy
one EPP per InferencePool.

Why: a GIE Gateway asks the EPP its InferencePool names, and the protocol says that EPP
picks only from the pods the pool's selector defines. The chart's picker serves every pool
by model (its own Envoy sends every model through it), so behind a GIE Gateway each pool
gets a picker scoped to it (`sluice epp --pool-name`), and its GIE InferencePool names that
picker's Service.

Policy: the EPP is the chart's picker Deployment (`GieConfig.picker_template`, read from the
API server) with its pod spec kept whole (image, keys, TLS, Redis, probes, security) and
only its discovery changed: `--namespace` / `--pool` arguments replaced by `--pool-name`,
`--pool-namespace` and GIE's `--pool-group`. Its pods carry labels of their own
(`sluice-epp`), so neither the chart's picker Services nor the pool's engine selectors take
them. Both children are owned by the pool: deleting the pool removes them. `render_epp` is
pure, like `render.render_pool`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from sluice import labels
from sluice.operator import kube
from sluice.operator.render import Manifest, owner_reference, spec_hash
from sluice.operator.spec import PoolSpec

EPP_NAME = "sluice-epp"  # the EPP pods' app.kubernetes.io/name (the chart's policies select it)
EPP_POOL = "sluice.dev/epp-pool"
PICKER_CONTAINER = "picker"
_REPLACED = ("--namespace", "--pool", "--pool-name", "--pool-namespace", "--pool-group")


def epp_name(pool: str) -> str:
    return f"{pool}-epp"


def _scoped_args(args: list[str], pool: PoolSpec) -> list[str]:
    kept = [a for a in args if a.split("=", 1)[0] not in _REPLACED]
    return [*kept, f"--pool-name={pool.name}", f"--pool-namespace={pool.namespace}",
            f"--pool-group={kube.GIE_POOLS.group}"]


def _child_metadata(pool: PoolSpec, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": pool.namespace,
            "labels": {labels.NAME: EPP_NAME, labels.MANAGED_BY: labels.OPERATOR_NAME,
                       labels.POOL: pool.name},
            "annotations": {}, "ownerReferences": [owner_reference(pool.name, pool.uid)]}


def render_epp(pool: PoolSpec, template: Mapping[str, Any]) -> list[Manifest]:
    """The pool's EPP Deployment and Service, from `template` (the chart's picker
    Deployment as the API server returns it). ValueError: it has no picker container."""
    pod = copy.deepcopy(template["spec"]["template"])
    containers = pod["spec"]["containers"]
    picker = next((c for c in containers if c["name"] == PICKER_CONTAINER), None)
    if picker is None:
        raise ValueError(f"{template['metadata']['name']} has no {PICKER_CONTAINER!r} "
                         "container to run as the pool's endpoint picker")
    picker["args"] = _scoped_args(list(picker.get("args") or ()), pool)
    pod_labels = {labels.NAME: EPP_NAME, EPP_POOL: pool.name}
    pod["metadata"] = {"labels": pod_labels,
                       "annotations": dict((pod.get("metadata") or {}).get("annotations") or {})}
    name = epp_name(pool.name)
    deployment: Manifest = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _child_metadata(pool, name),
        "spec": {"replicas": int(template["spec"].get("replicas") or 1),
                 "selector": {"matchLabels": pod_labels}, "template": pod}}
    tls = "--secure-serving" in picker["args"]
    service: Manifest = {
        "apiVersion": "v1", "kind": "Service", "metadata": _child_metadata(pool, name),
        "spec": {"selector": pod_labels, "ports": [
            {"name": "grpc", "port": 9002, "targetPort": "grpc", "protocol": "TCP",
             "appProtocol": "https" if tls else "kubernetes.io/h2c"},
            {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP",
             "appProtocol": "http"}]}}
    for manifest in (deployment, service):
        manifest["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] = spec_hash(manifest)
    return [deployment, service]
