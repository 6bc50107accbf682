"""Pure rendering: an InferencePool spec → the desired child manifests.

`render_pool(pool, config)` returns, in apply order, the headless Service, then per
role a Deployment (RollingUpdate as `spec.rollout` says) and a PodDisruptionBudget (as
`spec.podDisruptionBudget` says). Every child carries the common labels,
an ownerReference to the pool (so deleting the pool garbage-collects it) and a
`sluice.dev/spec-hash` annotation (hash of the rendered object itself) for change
detection. Same input → byte-identical output; no I/O.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sluice import labels
from sluice.operator import crd, engine_args, render_lora, tensor_parallel
from sluice.operator.sources import HuggingFaceSource, PvcSource
from sluice.operator.spec import DECODE, PREFILL, PoolSpec, RoleSpec

Manifest = dict[str, Any]


@dataclass(frozen=True)
class RenderConfig:
    """Operator-wide rendering defaults (from `sluice operator` flags)."""

    engine_image: str = "ghcr.io/sluice-dev/sluice-engine:0.1.0"
    vllm_image: str = "vllm/vllm-openai:v0.11.0"
    startup_timeout_s: int = 1800  # model download + load before liveness applies
    # The Secret (in the pool's namespace) holding the engines' own API key, as
    # `$VLLM_API_KEY` (ours and vLLM's engines read it); None: engines without a key.
    engine_key_secret: str | None = None
    engine_key_key: str = "key"
    # The Secret (in the pool's namespace) with the engines' CURVE keys for their KV-event
    # sockets (`sluice.zmq_curve.ENGINE_FILES`); None: plain sockets. See _kv_events_curve.
    kv_events_curve_secret: str | None = None
    # The Secret (in the pool's namespace) with the KV-transfer sockets' CURVE keys, all four
    # files (`sluice.zmq_curve_secrets --kv-transfer`); None: plain. See _kv_transfer_curve.
    kv_transfer_curve_secret: str | None = None


TMP_DIR = "/tmp"
KV_EVENTS_CURVE_DIR = "/etc/sluice/kv-events-curve"
KV_TRANSFER_CURVE_DIR = "/etc/sluice/kv-transfer-curve"
# Each role's half of the KV-transfer keys (`sluice.zmq_curve`'s file names; no pyzmq here):
# a prefill engine's block server is the CURVE server and admits the client key only, a
# decode engine's puller is the client.
KV_TRANSFER_CURVE_FILES = {PREFILL: ("server.key_secret", "client.key"),
                           DECODE: ("client.key_secret", "server.key")}


def child_name(pool: str, role: str) -> str:
    return f"{pool}-{role}"


def owner_reference(name: str, uid: str) -> dict[str, object]:
    """The pool as the controller of a child: the garbage collector deletes the child with
    it, and blockOwnerDeletion is why the operator needs update on inferencepools/finalizers."""
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def spec_hash(manifest: Manifest) -> str:
    body = copy.deepcopy(manifest)
    body.get("metadata", {}).get("annotations", {}).pop(labels.SPEC_HASH_ANNOTATION, None)
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _metadata(pool: PoolSpec, name: str, extra_labels: dict[str, str] | None = None) -> Manifest:
    return {
        "name": name, "namespace": pool.namespace,
        "labels": {**labels.common_labels(pool.name), **(extra_labels or {})},
        "annotations": {},
        "ownerReferences": [owner_reference(pool.name, pool.uid)],
    }


def _stamp(manifest: Manifest) -> Manifest:
    manifest["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] = spec_hash(manifest)
    return manifest


def render_service(pool: PoolSpec) -> Manifest:
    return _stamp({
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(pool, pool.name),
        "spec": {
            "clusterIP": "None", "publishNotReadyAddresses": False,
            "selector": {labels.POOL: pool.name, labels.NAME: labels.ENGINE_NAME},
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                      for n, p in labels.PORTS],
        },
    })


def render_pdb(pool: PoolSpec, role: RoleSpec) -> Manifest:
    budget = pool.disruption
    limit = ({"minAvailable": budget.min_available} if budget.min_available is not None
             else {"maxUnavailable": budget.max_unavailable})
    return _stamp({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _metadata(pool, child_name(pool.name, role.name), {labels.ROLE: role.name}),
        "spec": {**limit,
                 "selector": {"matchLabels": labels.selector_labels(pool.name, role.name)}},
    })


def _env(pool: PoolSpec, config: RenderConfig | None = None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HF_HOME", "value": engine_args.HF_HOME},
        # The root filesystem is read-only: every cache goes to /tmp (an emptyDir)
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{TMP_DIR}/.cache"},
    ]
    if isinstance(pool.source, HuggingFaceSource) and pool.source.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": pool.source.token_secret, "key": pool.source.token_key}}})
    if config is not None and config.engine_key_secret:
        # optional: a pool in a namespace without the Secret still starts (keyless)
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": config.engine_key_secret, "key": config.engine_key_key,
            "optional": True}}})
    return env + render_lora.lora_env(pool) + [dict(e) for e in pool.engine.env]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _volumes(pool: PoolSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": pool.cache_claim}} if pool.cache_claim
        else {"emptyDir": {"sizeLimit": pool.cache_size_limit}})
    volumes = [{"name": "model-cache", **cache}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "model-cache", "mountPath": engine_args.MODEL_CACHE_DIR},
              {"name": "tmp", "mountPath": TMP_DIR}]
    if isinstance(pool.source, PvcSource):
        volumes.append({"name": "models", "persistentVolumeClaim": {
            "claimName": pool.source.claim_name, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": engine_args.PVC_MOUNT_DIR,
                       "readOnly": True})
    shm = tensor_parallel.shm(pool)
    if shm is not None:  # NCCL / torch IPC need a real /dev/shm
        volumes.append({"name": "dshm", "emptyDir": shm})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    lora_volumes, lora_mounts = render_lora.adapter_volumes(pool)
    return volumes + lora_volumes, mounts + lora_mounts


def _kv_events_curve(pool: PoolSpec, config: RenderConfig) -> tuple[list[Any], list[Any],
                                                                      list[str]]:
    """(volumes, mounts, engine flags) for CURVE on the KV-event sockets. Sluice engines
    only: vLLM has no CURVE, so its pools stay plain, behind the NetworkPolicy."""
    if not config.kv_events_curve_secret or pool.engine.kind == "vllm":
        return [], [], []
    volume = {"name": "kv-events-curve", "secret": {
        "secretName": config.kv_events_curve_secret, "defaultMode": 0o400}}
    mount = {"name": "kv-events-curve", "mountPath": KV_EVENTS_CURVE_DIR, "readOnly": True}
    return [volume], [mount], ["--kv-events-curve-dir", KV_EVENTS_CURVE_DIR]


def _kv_transfer_curve(pool: PoolSpec, role: str, config: RenderConfig
                       ) -> tuple[list[Any], list[Any], str | None]:
    """(volumes, mounts, curve_dir for --kv-transfer-config) for CURVE on the KV-transfer
    sockets of a Sluice prefill/decode pool's `role`: its half of the Secret only, so a
    decode engine cannot serve blocks and a prefill engine cannot pull them. Without the
    Secret in the namespace the pod waits for it rather than serve blocks in the clear."""
    files = KV_TRANSFER_CURVE_FILES.get(role)
    if not config.kv_transfer_curve_secret or not pool.disaggregated or files is None:
        return [], [], None
    volume = {"name": "kv-transfer-curve", "secret": {
        "secretName": config.kv_transfer_curve_secret, "defaultMode": 0o400,
        "items": [{"key": f, "path": f} for f in files]}}
    mount = {"name": "kv-transfer-curve", "mountPath": KV_TRANSFER_CURVE_DIR, "readOnly": True}
    return [volume], [mount], KV_TRANSFER_CURVE_DIR


def _init_containers(pool: PoolSpec, image: str, mounts: list[dict[str, Any]]) -> list[Any]:
    src = pool.source
    if not isinstance(src, HuggingFaceSource) or pool.engine.kind == "vllm":
        return []
    env = _env(pool)[1:] + [
        {"name": "SLUICE_HF_REPO", "value": src.repo},
        {"name": "SLUICE_HF_REVISION", "value": src.revision or ""},
        {"name": "SLUICE_MODEL_DIR", "value": engine_args.hf_download_dir(src)},
    ]
    return [{"name": "fetch-model", "image": image,
             "command": ["python", "-c", engine_args.fetch_model_script()],
             "env": env, "volumeMounts": mounts,
             "securityContext": _container_security(pool)}]


def _container_security(pool: PoolSpec) -> dict[str, Any]:
    """Pod Security's restricted profile, for vLLM's image too, with a read-only root."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _ports(pool: PoolSpec) -> tuple[tuple[str, int], ...]:
    if pool.disaggregated:
        return (*labels.PORTS, ("kv-transfer", labels.KV_TRANSFER_PORT))
    return labels.PORTS


# A deleted engine keeps serving this long: every router (our picker and Envoy by EDS, another
# Gateway by its own Endpoints watch) stops sending new requests before the listener closes.
PRESTOP_S = 10
TERMINATION_GRACE_S = 60  # the pre-stop wait, then in-flight generations drain


def render_pod_template(pool: PoolSpec, role: RoleSpec, config: RenderConfig) -> Manifest:
    default = config.vllm_image if pool.engine.kind == "vllm" else config.engine_image
    image = pool.engine.image or default
    transfer_volumes, transfer_mounts, transfer_dir = _kv_transfer_curve(pool, role.name, config)
    command, args = engine_args.engine_command(pool, role.name, transfer_dir)
    volumes, mounts = _volumes(pool)
    curve_volumes, curve_mounts, curve_args = _kv_events_curve(pool, config)
    curve_volumes += transfer_volumes
    curve_mounts += transfer_mounts
    container = {
        "name": "engine", "image": image, "command": command, "args": args + curve_args,
        "env": _env(pool, config),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in _ports(pool)],
        "resources": tensor_parallel.pod_resources(pool, role.resources),
        "startupProbe": _probe("/health", 10, max(1, config.startup_timeout_s // 10)),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 10, 6),
        # A deleted engine keeps serving this long before it is told to stop: the picker
        # drops it at once, but a gateway that learns engines by DNS (the chart's Envoy:
        # re-resolved every 5 s, behind CoreDNS's TTL) may still send it a retry meanwhile.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_S}}},
        "volumeMounts": mounts + curve_mounts,
        "securityContext": _container_security(pool),
    }
    pod: dict[str, Any] = {
        "containers": [container], "volumes": volumes + curve_volumes,
        "initContainers": _init_containers(pool, image, mounts),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # engines never call the API server
        # (vLLM's image runs as root by default; it runs as this user as well)
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                            "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    optional = {
        "nodeSelector": dict(pool.node_selector) or None,
        "tolerations": [dict(t) for t in pool.tolerations] or None,
        "affinity": dict(pool.affinity) if pool.affinity else None,
        "priorityClassName": pool.priority_class_name,
        "imagePullSecrets": [{"name": n} for n in pool.image_pull_secrets] or None,
        "serviceAccountName": pool.service_account_name,
    }
    pod.update({k: v for k, v in optional.items() if v is not None})
    if not pod["initContainers"]:
        del pod["initContainers"]
    return {
        "metadata": {"labels": labels.pod_labels(pool.name, role.name),
                     "annotations": {labels.MODEL_ANNOTATION: pool.model_name,
                                     labels.KV_EVENTS_CURVE_ANNOTATION:
                                         "true" if curve_args else "false",
                                     "prometheus.io/scrape": "true",
                                     "prometheus.io/port": str(labels.HTTP_PORT),
                                     "prometheus.io/path": "/metrics"}},
        "spec": pod,
    }


def render_deployment(pool: PoolSpec, role: RoleSpec, config: RenderConfig) -> Manifest:
    return _stamp({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(pool, child_name(pool.name, role.name), {labels.ROLE: role.name}),
        "spec": {
            "replicas": role.replicas,
            "selector": {"matchLabels": labels.selector_labels(pool.name, role.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": pool.rollout.max_surge,
                "maxUnavailable": pool.rollout.max_unavailable}},
            "template": render_pod_template(pool, role, config),
        },
    })


def render_pool(pool: PoolSpec, config: RenderConfig = RenderConfig()) -> list[Manifest]:
    """All desired children of a pool, in apply order (Service, then per role). A PDB only
    while `podDisruptionBudget.enabled` (switched off, it is pruned as an orphan)."""
    out = [render_service(pool)]
    for role in pool.roles:
        out.append(render_deployment(pool, role, config))
        if pool.disruption.enabled:
            out.append(render_pdb(pool, role))
    return out
