"""Operator benchmark against a real control plane on loopback: etcd, kube-apiserver and
kube-controller-manager (`tests/kube_api.py`), no nodes.

Measures the issue's targets: a new pool has all children and a status within 1 s;
N pools (default 200) converge to Ready within 30 s; drift (a deleted or hand-edited
Deployment) is repaired within 5 s. The operator runs for real (kopf + Reconciler) in
its own thread and event loop; the controller-manager turns its Deployments into
ReplicaSets and pods, which the kubelet stand-in (`tests/k8s_kubelet.py`) reports Ready
from the main loop. Every figure is read back through the API server, as a user sees it.

A development tool: it uses the test helpers in `tests/` and the binaries
`scripts/build_k8s.py` builds (`make install`), so it needs the `test` extra and a source
checkout.

    python -m sluice.operator.bench [--pools 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "bench"
POOL = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "InferencePool",
    "metadata": {"name": "p", "namespace": NS},
    "spec": {"model": {"name": "smollm2-135m-instruct"}, "replicas": 1,
             "engine": {"kind": "sluice", "kvCacheMemory": "512MiB"}},
}


def _pool(name: str) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    body["metadata"]["name"] = name
    return body


def _is_ready(pool: dict[str, Any]) -> bool:
    status = pool.get("status") or {}
    return status.get("observedGeneration") == pool["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))


async def _all_ready(api: Any, kube: Any, names: set[str]) -> bool:
    """One LIST for all pools (not a GET per pool: the poll is not the load measured)."""
    ready = {p["metadata"]["name"] for p in await api.list(kube.POOLS, NS) if _is_ready(p)}
    return names <= ready


async def _has_status(api: Any, kube: Any, name: str) -> bool:
    try:
        pool = await api.get(kube.POOLS, NS, name)
        if not (pool.get("status") or {}).get("conditions"):
            return False
        await api.get(kube.DEPLOYMENTS, NS, f"{name}-serve")
        await api.get(kube.SERVICES, NS, name)
        await api.get(kube.PDBS, NS, f"{name}-serve")
    except kube.NotFound:
        return False
    return True


async def _until(check: Callable[[], Awaitable[bool]], timeout: float,
                 interval: float = 0.01) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if await check():
            return time.perf_counter() - t0
        await asyncio.sleep(interval)
    return float("inf")


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 4),
            "p90_s": round(xs[int(0.9 * (len(xs) - 1))], 4), "max_s": round(xs[-1], 4)}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(pools: int, singles: int, drifts: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from k8s_harness import client, operator
    from k8s_kubelet import kubelet
    from kube_api import control_plane

    from sluice.operator import crd, kube

    results: dict[str, Any] = {}
    with (tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp,
          control_plane(pathlib.Path(tmp)) as plane):
        plane.start_controllers()
        plane.kubectl("apply", "--server-side", "-f", str(crd.CRD_PATHS[0]))
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      f"crd/{crd.CRD_NAME}")
        plane.kubectl("create", "namespace", NS)
        # the kubelet stand-in LISTs the namespace's pods each round: not too often, as
        # that list grows to every pod of every pool
        async with (client(plane.admin_kubeconfig) as api, operator(plane) as rt,
                    kubelet(api, NS, interval=0.2)):
            # 1. one new pool at a time: children + status
            latencies = []
            for i in range(singles):
                await api.create(kube.POOLS, NS, _pool(f"single-{i}"))
                check = functools.partial(_has_status, api, kube, f"single-{i}")
                latencies.append(await _until(check, 10))
            results["new_pool_children_and_status"] = _summary(latencies)
            # 2. many pools at once, until every one is Ready (pods reported ready)
            planes0 = {name: _cpu_s(p.pid) for name, p in plane.procs.items()}
            t0, cpu0 = time.perf_counter(), time.process_time()
            for i in range(pools):
                await api.create(kube.POOLS, NS, _pool(f"many-{i:03d}"))
            created = time.perf_counter() - t0
            names = {f"many-{i:03d}" for i in range(pools)}
            converge = await _until(functools.partial(_all_ready, api, kube, names), 300, 0.1)
            results["pools_converge"] = {
                "pools": pools, "create_s": round(created, 3),
                "all_ready_s": round(created + converge, 3),
                # CPU of this process (operator + kubelet stand-in + this client): stable
                # on a shared machine
                "process_cpu_s": round(time.process_time() - cpu0, 2),
                # and of the control plane's processes meanwhile
                "control_plane_cpu_s": {name: round(_cpu_s(p.pid) - planes0[name], 2)
                                        for name, p in plane.procs.items()},
                "reconcile_passes": rt.reconciler.passes}
            # 3. drift: delete a Deployment / edit its image, until repaired
            deleted, edited = [], []
            for i in range(drifts):
                name = f"many-{i:03d}-serve"
                uid = (await api.get(kube.DEPLOYMENTS, NS, name))["metadata"]["uid"]
                await api.delete(kube.DEPLOYMENTS, NS, name)
                check = functools.partial(_recreated, api, kube, name, uid)
                deleted.append(await _until(check, 10))
                await _hand_edit(api, kube, name)
                edited.append(await _until(functools.partial(_restored, api, kube, name), 10))
            results["drift_deleted_deployment"] = _summary(deleted)
            results["drift_edited_deployment"] = _summary(edited)
    results["operator_thread_cpu_s_total"] = round(rt.stats.get("operator_thread_cpu_s", 0), 2)
    return results


async def _hand_edit(api: Any, kube: Any, name: str) -> None:
    """What `kubectl edit` does: read, change the image, write; again on a 409."""
    for _ in range(20):
        live = await api.get(kube.DEPLOYMENTS, NS, name)
        live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
        try:
            await api.replace(kube.DEPLOYMENTS, NS, name, live)
            return
        except kube.Conflict:
            await asyncio.sleep(0.01)
    raise RuntimeError(f"could not edit {name}")


async def _recreated(api: Any, kube: Any, name: str, uid: str) -> bool:
    try:
        return (await api.get(kube.DEPLOYMENTS, NS, name))["metadata"]["uid"] != uid
    except kube.NotFound:
        return False


async def _restored(api: Any, kube: Any, name: str) -> bool:
    dep = await api.get(kube.DEPLOYMENTS, NS, name)
    return dep["spec"]["template"]["spec"]["containers"][0]["image"] != "evil:latest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="benchmark the operator against a real kube-apiserver on loopback")
    parser.add_argument("--pools", type=int, default=200)
    parser.add_argument("--singles", type=int, default=20)
    parser.add_argument("--drifts", type=int, default=20)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    load0 = os.getloadavg()[0]
    results = asyncio.run(run(args.pools, args.singles, args.drifts))
    results["machine"] = {"cpus": os.cpu_count(), "loadavg_1m_before": round(load0, 2),
                          "loadavg_1m_after": round(os.getloadavg()[0], 2)}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    targets = (results["new_pool_children_and_status"]["max_s"] <= 1.0,
               results["pools_converge"]["all_ready_s"] <= 30.0,
               results["drift_deleted_deployment"]["max_s"] <= 5.0,
               results["drift_edited_deployment"]["max_s"] <= 5.0)
    print("targets met" if all(targets) else f"targets missed: {targets}")
    return 0 if all(targets) else 1


if __name__ == "__main__":
    sys.exit(main())
