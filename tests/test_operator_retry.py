"""Failed passes are retried with backoff: a child-event pass (kopf does not retry event
handlers) by the Retrier, within seconds rather than at the next resync. The API server's
transient failures (a 503 while etcd changes leader) come from a fault-injecting proxy in
front of the real one (tests/kube_faults.py): a real server gives none on demand."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import aiohttp
import pytest
import yaml
from k8s_harness import View, client, eventually, operator
from kube_faults import FaultProxy

from sluice.operator import kube
from sluice.operator.retry import Backoff, Retrier

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())


def test_backoff_doubles_up_to_its_cap():
    backoff = Backoff(first_s=0.5, factor=2, max_s=4, jitter=0)
    assert [backoff.delay(i) for i in range(6)] == [0.5, 1, 2, 4, 4, 4]
    jittered = Backoff(first_s=1, jitter=0.1)
    assert all(0.9 <= jittered.delay(0) <= 1.1 for _ in range(100))


def test_transient_errors_are_retried_and_final_ones_are_not():
    slept: list[float] = []

    async def sleep(s):
        slept.append(s)

    async def scenario():
        retrier = Retrier(Backoff(first_s=1, jitter=0, attempts=3), sleep=sleep)
        outcomes = [kube.ApiError(503, "ServiceUnavailable", "etcd leader changed"),
                    aiohttp.ClientConnectionError("refused"),
                    kube.ApiError(429, "TooManyRequests", ""), None]
        calls = 0

        async def attempt():
            nonlocal calls
            outcome, calls = outcomes[calls], calls + 1
            if outcome is not None:
                raise outcome

        await retrier.run("pool", attempt)  # fails now, retried in the background
        assert retrier.pending("pool")
        await retrier.run("pool", attempt)  # a second failure: still one retry task
        await eventually(lambda: not retrier.pending("pool"), 3, "retries done")
        assert calls == 4  # 503, refused (2nd run), 429, then success
        assert slept == [1, 2]

        async def refused():
            raise kube.ApiError(422, "Invalid", "spec.replicas: must be >= 0")

        with pytest.raises(kube.ApiError):  # the API server's final answer: not retried
            await retrier.run("other", refused)
        assert not retrier.pending("other")
        await retrier.close()

    asyncio.run(scenario())


def test_a_503_during_drift_repair_is_repaired_within_the_backoff_not_the_resync(
        kube_plane, kube_ns):
    """The Deployment deleted by hand, and the API server answers 503 to the first two
    applies that would recreate it. The pool has no engines, so no pods come and go even
    where kube-controller-manager runs: the deletion is the only event, and without a retry
    the repair would wait for the resync (30 s here)."""
    plane, ns = kube_plane, kube_ns
    body = copy.deepcopy(CPU_POOL)
    body["spec"]["replicas"] = 0

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, FaultProxy(plane) as proxy,
                    operator(plane, kubeconfig=proxy.kubeconfig(), namespaces=(ns,),
                             resync_interval_s=30.0) as rt):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, body)

            async def handled() -> bool:
                # the create handler done (else its own retry, kopf's, would do the repair)
                pool = await view.pool()
                return ("sluice.dev/last-handled-configuration"
                        in pool["metadata"].get("annotations", {}) and bool(pool.get("status")))
            await eventually(handled, 20, "pool handled")
            uid = (await view.get(kube.DEPLOYMENTS, "smollm2-serve"))["metadata"]["uid"]
            fault = proxy.fail_next("PATCH", "deployments", 503, count=2,
                                    message="etcdserver: leader changed")
            await api.delete(kube.DEPLOYMENTS, ns, "smollm2-serve")

            async def recreated() -> bool:
                return (await view.get(kube.DEPLOYMENTS, "smollm2-serve"))["metadata"][
                    "uid"] != uid
            await eventually(recreated, 10, "recreated within the backoff (0.5 s, then 1 s)")
            assert fault.count == 0  # both 503s were met
            assert rt.retrier.retries == 2
    asyncio.run(asyncio.wait_for(scenario(), 90))
