"""Operator benchmark against the in-process API server emulator (no cluster needed).

Measures the issue's targets: a new pool has all children and a status within 1 s;
N pools (default 200) converge to Ready within 30 s; drift (a deleted or hand-edited
Deployment) is repaired within 5 s. The operator runs for real (kopf + Reconciler) in
its own thread and event loop; the emulator and a simulated Deployment controller /
kubelet run in the main loop, like separate processes.

A development tool: it uses the test helpers in `tests/` (kmock, the emulator), so it
needs the `test` extra and a source checkout.

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
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
POOL = {
    "apiVersion": "sluice.dev/v1alpha1", "kind": "InferencePool",
    "metadata": {"name": "p", "namespace": "bench"},
    "spec": {"model": {"name": "smollm2-135m-instruct"}, "replicas": 1,
             "engine": {"kind": "sluice", "kvCacheMemory": "512MiB"}},
}


def _pool(name: str) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    body["metadata"]["name"] = name
    return body


def _ready(api: Any, name: str) -> bool:
    try:
        pool = api.store.get(api.kind("inferencepools"), "bench", name)
    except api.NotFound:
        return False
    status = pool.get("status") or {}
    return status.get("observedGeneration") == pool["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))


def _has_status(api: Any, name: str) -> bool:
    try:
        pool = api.store.get(api.kind("inferencepools"), "bench", name)
        api.store.get(api.kind("deployments"), "bench", f"{name}-serve")
        api.store.get(api.kind("services"), "bench", name)
        api.store.get(api.kind("poddisruptionbudgets"), "bench", f"{name}-serve")
    except api.NotFound:
        return False
    return bool((pool.get("status") or {}).get("conditions"))


async def _until(check: Any, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if check():
            return time.perf_counter() - t0
        await asyncio.sleep(0.005)
    return float("inf")


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 4),
            "p90_s": round(xs[int(0.9 * (len(xs) - 1))], 4), "max_s": round(xs[-1], 4)}


async def run(pools: int, singles: int, drifts: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from k8s_controllers import controllers
    from k8s_harness import cluster, connection, operator

    from sluice.operator import kube

    results: dict[str, Any] = {}
    async with cluster() as (api, server), operator(server) as rt, controllers(api, 0.05):
        client = kube.KubeClient.from_connection(connection(server))
        # 1. one new pool at a time: children + status
        latencies = []
        for i in range(singles):
            await client.create(kube.POOLS, "bench", _pool(f"single-{i}"))
            name = f"single-{i}"
            latencies.append(await _until(functools.partial(_has_status, api, name), 10))
        results["new_pool_children_and_status"] = _summary(latencies)
        # 2. many pools at once, until every one is Ready (pods simulated as ready)
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(pools):
            await client.create(kube.POOLS, "bench", _pool(f"many-{i:03d}"))
        created = time.perf_counter() - t0
        names = [f"many-{i:03d}" for i in range(pools)]
        converge = await _until(lambda: all(_ready(api, n) for n in names), 120)
        results["pools_converge"] = {"pools": pools, "create_s": round(created, 3),
                                     "all_ready_s": round(created + converge, 3),
                                     # CPU of the whole process (operator + emulator +
                                     # simulated controllers): stable on a shared machine
                                     "process_cpu_s": round(time.process_time() - cpu0, 2),
                                     "reconcile_passes": rt.reconciler.passes}
        # 3. drift: delete a Deployment / edit its image, until repaired
        deleted, edited = [], []
        for i in range(drifts):
            name = f"many-{i:03d}-serve"
            uid = api.store.get(api.kind("deployments"), "bench", name)["metadata"]["uid"]
            await client.delete(kube.DEPLOYMENTS, "bench", name)
            deleted.append(await _until(functools.partial(_recreated, api, name, uid), 10))
            await _hand_edit(client, kube, name)
            edited.append(await _until(functools.partial(_restored, api, name), 10))
        results["drift_deleted_deployment"] = _summary(deleted)
        results["drift_edited_deployment"] = _summary(edited)
        await client.close()
    results["operator_thread_cpu_s_total"] = round(rt.stats.get("operator_thread_cpu_s", 0), 2)
    return results


async def _hand_edit(client: Any, kube: Any, name: str) -> None:
    """What `kubectl edit` does: read, change the image, write; again on a 409."""
    for _ in range(20):
        live = await client.get(kube.DEPLOYMENTS, "bench", name)
        live["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
        try:
            await client.replace(kube.DEPLOYMENTS, "bench", name, live)
            return
        except kube.Conflict:
            await asyncio.sleep(0.01)
    raise RuntimeError(f"could not edit {name}")


def _recreated(api: Any, name: str, uid: str) -> bool:
    try:
        return api.store.get(api.kind("deployments"), "bench", name)["metadata"]["uid"] != uid
    except api.NotFound:
        return False


def _restored(api: Any, name: str) -> bool:
    dep = api.store.get(api.kind("deployments"), "bench", name)
    return dep["spec"]["template"]["spec"]["containers"][0]["image"] != "evil:latest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="benchmark the operator against the emulator")
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
