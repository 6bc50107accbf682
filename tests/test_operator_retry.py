"""Failed passes are retried with backoff: a child-event pass (kopf does not retry event
handlers) by the Retrier, within seconds rather than at the next resync."""

from __future__ import annotations

import asyncio
import pathlib

import httpx
import pytest
import yaml
from k8s_harness import cluster, connection, eventually, operator

from sluice.operator import kube
from sluice.operator.retry import Backoff, Retrier

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
NS, NAME = "default", "smollm2"


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
                    httpx.ConnectError("refused"), kube.ApiError(429, "TooManyRequests", ""),
                    None]
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
        assert calls == 4 and slept == [1, 2]  # 503, refused (2nd run), 429, then success

        async def refused():
            raise kube.ApiError(422, "Invalid", "spec.replicas: must be >= 0")

        with pytest.raises(kube.ApiError):  # the API server's final answer: not retried
            await retrier.run("other", refused)
        assert not retrier.pending("other")
        await retrier.close()

    asyncio.run(scenario())


def test_a_503_during_drift_repair_is_repaired_within_the_backoff_not_the_resync():
    """The Deployment deleted by hand, and the API server answers 503 to the first two
    creates. No controllers run, so the deletion is the only event: without a retry the
    repair would wait for the resync (30 s here)."""
    async def scenario():
        async with cluster() as (api, server), operator(server, resync_interval_s=30.0) as rt:
            client = kube.KubeClient.from_connection(connection(server))
            await client.create(kube.POOLS, NS, CPU_POOL)
            dep = lambda: api.store.get(api.kind("deployments"), NS, "smollm2-serve")
            pool = lambda: api.store.get(api.kind("inferencepools"), NS, NAME)
            # the create handler done (else its own retry, kopf's, would do the repair)
            await eventually(lambda: "sluice.dev/last-handled-configuration" in pool()[
                "metadata"]["annotations"] and pool().get("status"), 3, "pool handled")
            uid = dep()["metadata"]["uid"]
            api.fail_next("POST", "deployments", 503, count=2,
                          message="etcdserver: leader changed", reason="ServiceUnavailable")
            await client.delete(kube.DEPLOYMENTS, NS, "smollm2-serve")
            await eventually(lambda: dep()["metadata"]["uid"] != uid, 5,
                             "recreated within the backoff (0.5 s, then 1 s)")
            assert all(f.count == 0 for f in api.faults)  # both 503s were met
            assert rt.retrier.retries == 2
            await client.close()
    asyncio.run(asyncio.wait_for(scenario(), 60))
