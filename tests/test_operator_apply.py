"""apply.py against a real API server, without kopf: idempotence, the server's own
normalisation does not cause an apply loop, drift is repaired, a concurrent writer's
fields are kept, and a 409 on the write is left to the caller's retry."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from k8s_harness import client, eventually
from kube_api import ControlPlane
from kube_faults import FaultProxy

from sluice.operator import apply, credentials, kube
from sluice.operator.render import render_pool
from sluice.operator.retry import Backoff, Retrier
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
BODY = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
DEPLOYMENT = "smollm2-serve"


@contextlib.asynccontextmanager
async def operator_client(kubeconfig: pathlib.Path) -> AsyncIterator[kube.KubeClient]:
    """The client as the operator makes it: its field manager is `sluice-operator`."""
    api = kube.KubeClient.from_configuration(await credentials.load(kubeconfig))
    try:
        yield api
    finally:
        await api.close()


def _deployment(owner: dict[str, Any], resources: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The pool's Deployment as the operator renders it (`owner`: the pool as stored, so
    its uid is the children's owner: the API server collects those of an absent owner)."""
    body = copy.deepcopy(owner)
    if resources:
        body["spec"]["resources"] = resources
    return next(m for m in render_pool(PoolSpec.from_body(body)) if m["kind"] == "Deployment")


def _env(deployment: dict[str, Any]) -> dict[str, Any]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container.get("env") or ()}


def _writes(plane: ControlPlane, namespace: str) -> int:
    """The operator's Deployment writes in `namespace`, from the API server's audit log
    (kube-controller-manager's status writes, where it runs, are not ours)."""
    return sum(1 for e in plane.audit()
               if e["verb"] in ("create", "update", "patch")
               and e["objectRef"].get("resource") == "deployments"
               and e["objectRef"].get("namespace") == namespace
               and f"fieldManager={kube.FIELD_MANAGER}" in e["requestURI"])


def test_apply_is_idempotent_and_repairs_drift(kube_plane, kube_ns):
    plane, ns = kube_plane, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator_client(plane.admin_kubeconfig) as op):
            pool = await api.create(kube.POOLS, ns, BODY)
            uid = pool["metadata"]["uid"]
            memo: apply.AppliedMemo = {}
            desired = _deployment(pool)
            assert (await apply.apply_child(op, desired, uid, memo))[0] == "created"
            assert (await apply.apply_child(op, desired, uid, memo))[0] == "unchanged"
            # without the memo too: the server's defaults are not drift
            assert (await apply.apply_child(op, desired, uid, {}))[0] == "unchanged"
            # a hand edit of the spec (a patch, as `kubectl edit` sends) bumps the
            # generation: applied again, the operator's value back
            want = _env(desired)["HF_HOME"]
            live = await api.get(kube.DEPLOYMENTS, ns, DEPLOYMENT)
            containers = live["spec"]["template"]["spec"]["containers"]
            next(e for e in containers[0]["env"] if e["name"] == "HF_HOME")["value"] = "/elsewhere"
            edited = await api.patch(kube.DEPLOYMENTS, ns, DEPLOYMENT, {
                "spec": {"template": {"spec": {"containers": containers}}}})
            assert _env(edited)["HF_HOME"] == "/elsewhere"
            action, live = await apply.apply_child(op, desired, uid, memo)
            assert action == "updated"
            assert _env(live)["HF_HOME"] == want
            # a hand edit of our labels (no generation bump) is also repaired
            await api.patch(kube.DEPLOYMENTS, ns, DEPLOYMENT,
                            {"metadata": {"labels": {"sluice.dev/role": "x"}}})
            action, live = await apply.apply_child(op, desired, uid, memo)
            assert action == "updated"
            assert live["metadata"]["labels"]["sluice.dev/role"] == "serve"
            assert (await apply.apply_child(op, desired, uid, memo))[0] == "unchanged"
    asyncio.run(scenario())


def test_server_normalised_fields_do_not_cause_an_apply_loop(kube_plane, kube_ns):
    plane, ns = kube_plane, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator_client(plane.admin_kubeconfig) as op):
            pool = await api.create(kube.POOLS, ns, BODY)
            uid = pool["metadata"]["uid"]
            memo: apply.AppliedMemo = {}
            desired = _deployment(pool, {"requests": {"cpu": "1000m"}})
            _, live = await apply.apply_child(op, desired, uid, memo)
            # the API server canonicalises quantities (1000m -> 1): the live object is no
            # superset of the desired one any more
            resources = live["spec"]["template"]["spec"]["containers"][0]["resources"]
            assert resources["requests"]["cpu"] == "1"
            assert not apply.is_subset(desired["spec"], live["spec"])
            writes = _writes(plane, ns)
            for _ in range(3):
                action, _ = await apply.apply_child(op, desired, uid, memo)
                assert action == "unchanged"
            assert _writes(plane, ns) == writes
    asyncio.run(scenario())


def test_a_concurrent_writer_is_kept_and_a_409_is_retried(kube_plane, kube_ns):
    """Another writer's annotation survives our apply (server-side apply merges managers'
    fields), and a 409 on the write (from the fault proxy: a real server gives one to an
    apply only on a field-manager conflict, and ours are forced) is raised as transient,
    not reported as a rejection, for the Retrier to run the pass again."""
    plane, ns = kube_plane, kube_ns
    conflict = (f'Operation cannot be fulfilled on deployments.apps "{DEPLOYMENT}": the '
                "object has been modified; please apply your changes to the latest version "
                "and try again")

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, FaultProxy(plane) as proxy,
                    operator_client(proxy.kubeconfig()) as op):
            pool = await api.create(kube.POOLS, ns, BODY)
            uid = pool["metadata"]["uid"]
            await apply.apply_child(op, _deployment(pool), uid)
            await api.patch(kube.DEPLOYMENTS, ns, DEPLOYMENT,
                            {"metadata": {"annotations": {"other": "writer"}}})
            desired = [_deployment(pool, {"limits": {"memory": "8Gi"}})]
            fault = proxy.fail_next("PATCH", "deployments", 409, count=1, message=conflict)
            reports: list[apply.ApplyReport] = []

            async def attempt() -> None:
                reports.append(await apply.apply_all(op, desired, uid, prune_orphans=False))

            retrier = Retrier(Backoff(first_s=0.05, jitter=0))
            await retrier.run("pool", attempt)
            assert fault.count == 0
            assert retrier.pending("pool")
            await eventually(lambda: not retrier.pending("pool"), 10, "the retry done")
            await retrier.close()
            assert retrier.retries == 1
            assert [(r.updated, r.problems) for r in reports] == [([f"Deployment/{DEPLOYMENT}"],
                                                                   [])]
            live = await api.get(kube.DEPLOYMENTS, ns, DEPLOYMENT)
            assert live["metadata"]["annotations"]["other"] == "writer"  # not clobbered
            assert live["spec"]["template"]["spec"]["containers"][0]["resources"][
                "limits"]["memory"] == "8Gi"

            # the same 409 outside a retrier: raised, never a ChildRejected problem
            proxy.fail_next("PATCH", "deployments", 409, count=1, message=conflict)
            desired = [_deployment(pool, {"limits": {"memory": "6Gi"}})]
            with pytest.raises(kube.Conflict) as raised:
                await apply.apply_all(op, desired, uid, prune_orphans=False)
            assert kube.is_transient(raised.value)
            assert raised.value.message == conflict
    asyncio.run(scenario())


def test_triggers_during_a_pass_coalesce_into_one_more_pass_from_a_fresh_read(
        kube_plane, kube_ns):
    from sluice.operator.reconciler import Reconciler
    from sluice.operator.render import RenderConfig

    plane, ns = kube_plane, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator_client(plane.admin_kubeconfig) as op):
            created = await api.create(kube.POOLS, ns, BODY)
            reconciler = Reconciler(op, RenderConfig(), lambda *a: None)
            seen = []
            real_pass = reconciler._pass

            async def slow_pass(body):
                seen.append(body["spec"]["replicas"])
                if len(seen) == 1:  # while the first pass runs: a spec change + 3 triggers
                    await api.patch(kube.POOLS, ns, "smollm2", {"spec": {"replicas": 3}})
                    for _ in range(3):
                        await reconciler.reconcile(created)
                await real_pass(body)

            reconciler._pass = slow_pass
            await reconciler.reconcile(created)
            assert seen == [1, 3]  # exactly one more pass, with the re-read spec
            dep = await api.get(kube.DEPLOYMENTS, ns, DEPLOYMENT)
            assert dep["spec"]["replicas"] == 3
    asyncio.run(scenario())
