"""Flow control's policy (sluice/gateway/flow/): admission at once, priority order,
round-robin fairness between tenants, bounds (eviction, capacity), TTL, cancellation,
notify(), sheddable requests; the saturation detector's rule; GIE's config fields; the
metrics. Each scenario runs on its own event loop, within a second."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import yaml
from polling import eventually
from prometheus_client import CollectorRegistry

from sluice.gateway.flow import (
    Admitted,
    FlowControlConfig,
    FlowController,
    PriorityBandConfig,
    SaturationDetector,
    SaturationDetectorConfig,
    Shed,
)
from sluice.gateway.flow.config import GLOBAL_STRICT, ROUND_ROBIN
from sluice.gateway.flow.saturation import ConcurrencyDetectorConfig

POOL = "pool-a"


class Gate:
    """A saturation signal that lets `permits` requests through, then says saturated:
    a pool with that many free slots."""

    def __init__(self, permits: int = 0) -> None:
        self.permits = permits

    def __call__(self, priority: int = 0) -> bool:
        if self.permits <= 0:
            return True
        self.permits -= 1
        return False


def run(scenario, timeout: float = 5.0):
    return asyncio.run(asyncio.wait_for(scenario(), timeout))


def controller(**kw) -> FlowController:
    kw.setdefault("poll_interval_s", 0.005)
    return FlowController(FlowControlConfig(**kw), CollectorRegistry())


async def enqueue(fc, gate, specs, pool=POOL):
    """Start admit() for each (priority, tenant), in order, and wait until all wait."""
    tasks = []
    for i, (prio, tenant) in enumerate(specs):
        tasks.append(asyncio.create_task(fc.admit(pool, prio, tenant, gate)))
        await eventually(lambda n=i + 1: fc.queued(pool) == n, timeout=2, every_s=0.001)
    return tasks


def sample(fc, name, **labels):
    return fc.metrics.registry.get_sample_value(name, labels) or 0.0


def test_admitted_at_once_when_not_saturated():
    async def scenario():
        fc = controller()
        got = await fc.admit(POOL, 0, "t", lambda p: False)
        assert got == Admitted(0.0)
        assert fc.queued(POOL) == 0 and POOL not in fc.pools  # no queue was even made
        return fc
    fc = run(scenario)
    assert sample(fc, "sluice_gateway_flow_dispatched_total",
                  inference_pool=POOL, priority="0") == 1


def test_saturated_requests_wait_and_leave_highest_priority_first():
    async def scenario():
        fc, gate = controller(), Gate()
        specs = [(0, "a"), (2, "b"), (1, "c"), (2, "d"), (0, "e")]
        tasks = await enqueue(fc, gate, specs)
        await asyncio.sleep(0.02)  # several polls: still saturated, nobody leaves
        assert fc.queued(POOL) == 5 and not any(t.done() for t in tasks)
        fc.check_invariants()
        order = []
        for t, (prio, tenant) in zip(tasks, specs, strict=True):
            t.add_done_callback(lambda _, who=(prio, tenant): order.append(who))
        gate.permits = 5
        fc.notify(POOL)
        results = await asyncio.gather(*tasks)
        assert all(isinstance(r, Admitted) and r.waited_s > 0 for r in results)
        # bands highest first; within a band, arrival order (different tenants' turns)
        assert order == [(2, "b"), (2, "d"), (1, "c"), (0, "a"), (0, "e")]
        fc.check_invariants()
    run(scenario)


def test_a_request_waits_behind_its_own_priority_but_not_behind_lower_ones():
    async def scenario():
        fc, gate = controller(), Gate()
        low = await enqueue(fc, gate, [(0, "a")])
        # the pool has room again, but a request of priority 0 waits: no overtaking
        gate.permits = 1
        high = await fc.admit(POOL, 1, "b", gate)  # nothing waits at 1 or above: at once
        assert high == Admitted(0.0) and fc.queued(POOL) == 1 and not low[0].done()
        gate.permits = 1
        assert isinstance(await low[0], Admitted)
    run(scenario)


def _fair_shares(policy: str) -> Counter:
    async def scenario():
        band = PriorityBandConfig(fairness_policy=policy)
        fc, gate = controller(default_priority_band=band), Gate()
        flood = [(0, "flood")] * 60
        others = [(0, "b"), (0, "c")] * 20
        tasks = await enqueue(fc, gate, flood + others)
        served = Counter()
        for t, (_, tenant) in zip(tasks, flood + others, strict=True):
            t.add_done_callback(lambda _, who=tenant: served.update([who]))
        gate.permits = 30
        fc.notify(POOL)
        await eventually(lambda: sum(served.values()) == 30, timeout=2, every_s=0.001)
        await asyncio.sleep(0.02)  # the pool is saturated again: nobody else leaves
        assert sum(served.values()) == 30 and fc.queued(POOL) == 70
        fc.check_invariants()
        shares = Counter(served)
        await fc.close()
        return shares
    return run(scenario)


def test_round_robin_shares_a_band_between_tenants_when_one_floods():
    served = _fair_shares(ROUND_ROBIN)
    for tenant in ("flood", "b", "c"):
        assert 8 <= served[tenant] <= 12, served  # equal shares of 30, within 20%


def test_global_strict_serves_the_band_in_arrival_order():
    assert _fair_shares(GLOBAL_STRICT) == Counter({"flood": 30})


def test_a_full_pool_evicts_the_newest_of_the_lowest_priority_below():
    async def scenario():
        fc, gate = controller(max_requests=3), Gate()
        p1, p0_old, p0_new = await enqueue(fc, gate, [(1, "a"), (0, "b"), (0, "c")])
        high = asyncio.create_task(fc.admit(POOL, 2, "d", gate))
        shed = await asyncio.wait_for(p0_new, 1)
        assert shed.reason == "evicted" and shed.status == 429 and shed.retry_after_s >= 1
        await eventually(lambda: fc.queued(POOL) == 3, timeout=1, every_s=0.001)
        assert not p0_old.done() and not p1.done() and not high.done()
        # full, and nothing below priority 0: the newcomer is the one shed
        refused = await fc.admit(POOL, 0, "e", gate)
        assert refused.reason == "capacity" and refused.waited_s == 0.0
        assert fc.queued(POOL) == 3
        fc.check_invariants()
        gate.permits = 3
        fc.notify(POOL)
        assert all(isinstance(r, Admitted) for r in await asyncio.gather(p1, p0_old, high))
        return fc
    fc = run(scenario)
    for reason, prio in (("evicted", "0"), ("capacity", "0")):
        assert sample(fc, "sluice_gateway_flow_shed_total", inference_pool=POOL,
                      priority=prio, reason=reason) == 1


def test_a_full_band_sheds_even_with_lower_priorities_waiting():
    async def scenario():
        bands = (PriorityBandConfig(priority=5, max_requests=1),)
        fc, gate = controller(priority_bands=bands), Gate()
        low, top = await enqueue(fc, gate, [(0, "a"), (5, "b")])
        refused = await fc.admit(POOL, 5, "c", gate)  # evicting 0 would not free band 5
        assert refused == Shed("capacity", 1) and not low.done() and fc.queued(POOL) == 2
        await fc.close()
        assert (await low).reason == "evicted" and (await top).reason == "evicted"
        assert fc.queued(POOL) == 0
    run(scenario)


def test_the_byte_limit_evicts_as_many_lower_requests_as_it_takes():
    async def scenario():
        fc, gate = controller(max_bytes=100), Gate()
        small = [asyncio.create_task(fc.admit(POOL, 0, "a", gate, size=40)) for _ in range(2)]
        await eventually(lambda: fc.queued(POOL) == 2, timeout=1, every_s=0.001)
        big = asyncio.create_task(fc.admit(POOL, 1, "b", gate, size=90))
        assert [(await t).reason for t in small] == ["evicted", "evicted"]
        too_big = await fc.admit(POOL, 2, "c", gate, size=101)  # never fits
        assert too_big.reason == "capacity" and fc.queued(POOL) == 1 and not big.done()
        fc.check_invariants()
        await fc.close()
    run(scenario)


def test_a_request_that_waits_out_its_ttl_is_shed():
    async def scenario():
        fc = controller(default_request_ttl_s=0.05)
        got = await fc.admit(POOL, 0, "a", lambda p: True)
        assert got.reason == "ttl" and got.status == 503 and got.waited_s >= 0.05
        assert fc.queued(POOL) == 0
        fc.check_invariants()
        return fc
    fc = run(scenario)
    assert sample(fc, "inference_extension_flow_control_request_queue_duration_seconds_count",
                  inference_pool=POOL, priority="0", outcome="EvictedTTL") == 1


def test_a_cancelled_waiter_leaves_its_queue_and_blocks_nobody():
    async def scenario():
        fc, gate = controller(), Gate()
        first, gone, last = await enqueue(fc, gate, [(0, "a"), (0, "a"), (0, "a")])
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert fc.queued(POOL) == 2
        fc.check_invariants()
        gate.permits = 2
        fc.notify(POOL)
        assert all(isinstance(r, Admitted) for r in await asyncio.gather(first, last))
        # cancelled in the same turn as the release: the dispatcher meets it first
        a, b = await enqueue(fc, gate, [(0, "x"), (0, "y")])
        a.cancel()
        gate.permits = 1
        fc.notify(POOL)
        assert isinstance(await asyncio.wait_for(b, 1), Admitted)
        assert a.cancelled() and fc.queued(POOL) == 0
        fc.check_invariants()
        await eventually(lambda: fc.pools[POOL].task is None, timeout=1)  # no dispatcher left
        return fc
    fc = run(scenario)
    assert sample(fc, "inference_extension_flow_control_request_queue_duration_seconds_count",
                  inference_pool=POOL, priority="0", outcome="EvictedContextCancelled") == 2
    assert sample(fc, "inference_extension_flow_control_queue_size",
                  inference_pool=POOL, priority="0") == 0


def test_notify_releases_at_once_without_waiting_for_the_poll():
    async def scenario():
        fc, gate = controller(poll_interval_s=30.0), Gate()
        (waiter,) = await enqueue(fc, gate, [(0, "a")])
        gate.permits = 1
        fc.notify(POOL)
        got = await asyncio.wait_for(waiter, 0.5)  # the next poll would be 30 s away
        assert isinstance(got, Admitted) and got.waited_s < 0.5
    run(scenario)


def test_sheddable_requests_are_refused_at_once_while_saturated():
    async def scenario():
        fc = controller()
        got = await fc.admit(POOL, -1, "a", lambda p: True)
        assert got.reason == "sheddable" and got.status == 429 and fc.queued(POOL) == 0
        assert await fc.admit(POOL, -1, "a", lambda p: False) == Admitted(0.0)
        # shed_sheddable=False (GIE's flow control from v1.3): it waits, below priority 0
        fc, gate = controller(shed_sheddable=False), Gate()
        tasks = await enqueue(fc, gate, [(-1, "a"), (0, "b")])
        order = []
        for t, who in zip(tasks, ("a", "b"), strict=True):
            t.add_done_callback(lambda _, w=who: order.append(w))
        gate.permits = 2
        fc.notify(POOL)
        await asyncio.gather(*tasks)
        assert order == ["b", "a"]
    run(scenario)


def test_pools_queue_apart():
    async def scenario():
        fc, busy = controller(), Gate()
        (waiter,) = await enqueue(fc, busy, [(0, "a")], pool="busy")
        assert await fc.admit("idle", 0, "a", lambda p: False) == Admitted(0.0)
        assert fc.queued("busy") == 1 and fc.queued("idle") == 0
        await fc.close()
        assert (await waiter).reason == "evicted"
    run(scenario)


def test_retry_after_follows_the_release_rate():
    async def scenario():
        fc, gate = controller(max_requests=4), Gate()
        tasks = await enqueue(fc, gate, [(0, "a")] * 4)
        q = fc.pools[POOL]
        q.drain_s = 2.5  # (as if one request left every 2.5 s)
        refused = await fc.admit(POOL, 0, "b", gate)
        assert refused.reason == "capacity" and refused.retry_after_s == 10  # 4 x 2.5 s
        q.drain_s = 1000.0
        assert (await fc.admit(POOL, 0, "b", gate)).retry_after_s == 60  # the cap
        await fc.close()
        assert all(isinstance(r, Shed) for r in await asyncio.gather(*tasks))
    run(scenario)


# --- the saturation detector ---

NOW = 10_000.0


def row(waiting=0.0, kv=0.0, age_ms=0.0):
    return {"waiting": waiting, "running": 3.0, "kv_usage": kv, "ts_ms": NOW - age_ms}


def test_saturated_when_no_pod_has_capacity():
    d = SaturationDetector()  # GIE's defaults: 5 waiting, 0.8 KV, 200 ms
    assert not d.saturated([row()], NOW)
    assert not d.saturated([row(waiting=5, kv=0.8)], NOW)  # GIE's bounds are inclusive
    assert d.saturated([row(waiting=6)], NOW)
    assert d.saturated([row(kv=0.81)], NOW)
    assert d.saturated([row(age_ms=201)], NOW)  # stale: may have filled up meanwhile
    assert not d.saturated([row(age_ms=200)], NOW)
    assert d.saturated([None], NOW)  # unknown load: no capacity
    assert d.saturated([], NOW)  # no pod at all
    # one pod with room is enough
    assert not d.saturated([row(waiting=9), None, row(age_ms=500), row(kv=0.5)], NOW)
    tight = SaturationDetector(SaturationDetectorConfig(queue_depth_threshold=1,
                                                        kv_cache_util_threshold=0.5,
                                                        metrics_staleness_threshold_s=1.0))
    assert tight.saturated([row(waiting=2)], NOW) and not tight.saturated([row(age_ms=900)], NOW)


# --- GIE's configuration ---

def test_saturation_detector_config_reads_gie_fields():
    assert SaturationDetectorConfig.from_dict(None) == SaturationDetectorConfig()
    c = SaturationDetectorConfig.from_dict({"queueDepthThreshold": 10,
                                            "kvCacheUtilThreshold": 0.9,
                                            "metricsStalenessThreshold": "1m30s"})
    assert (c.queue_depth_threshold, c.kv_cache_util_threshold,
            c.metrics_staleness_threshold_s) == (10, 0.9, 90.0)
    with pytest.raises(ValueError, match="'queueDepth'.*queueDepthThreshold, "
                                         "kvCacheUtilThreshold, metricsStalenessThreshold"):
        SaturationDetectorConfig.from_dict({"queueDepth": 3})
    for bad in ({"kvCacheUtilThreshold": 1.5}, {"queueDepthThreshold": 0},
                {"metricsStalenessThreshold": 200}, {"metricsStalenessThreshold": "2 sec"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SaturationDetectorConfig.from_dict(bad)
    v15 = yaml.safe_load("""
plugins:
- name: sat
  type: utilization-detector
  parameters: {queueDepthThreshold: 7, metricsStalenessThreshold: 500ms}
saturationDetector: {pluginRef: sat}
""")
    c = SaturationDetectorConfig.from_epp(v15)
    assert (c.queue_depth_threshold, c.metrics_staleness_threshold_s) == (7, 0.5)
    v14 = {"saturationDetector": {"kvCacheUtilThreshold": 0.7}}
    assert SaturationDetectorConfig.from_epp(v14).kv_cache_util_threshold == 0.7
    assert SaturationDetectorConfig.from_epp({}) == SaturationDetectorConfig()
    with pytest.raises(ValueError, match="no such plugin"):
        SaturationDetectorConfig.from_epp({"saturationDetector": {"pluginRef": "x"}})


def test_flow_control_config_reads_gie_fields():
    assert FlowControlConfig.from_dict(None) == FlowControlConfig()
    c = FlowControlConfig.from_dict(yaml.safe_load("""
maxBytes: 1Gi
maxRequests: 1k
defaultRequestTTL: 30s
defaultPriorityBand:
  maxRequests: 100
  fairnessPolicyRef: global-strict-fairness-policy
priorityBands:
- priority: 10
  maxRequests: "50"
  fairnessPolicyRef: round-robin-fairness-policy
  orderingPolicyRef: fcfs-ordering-policy
- priority: -1
  maxBytes: 1.5k
pollInterval: 20ms
"""))
    assert (c.max_bytes, c.max_requests, c.default_request_ttl_s) == (2**30, 1000, 30.0)
    assert c.poll_interval_s == 0.02 and c.shed_sheddable
    assert c.band(10) == PriorityBandConfig(10, 1_000_000_000, 50, ROUND_ROBIN)
    # a listed band's unset fields take GIE's system defaults, not the default band's
    assert c.band(-1) == PriorityBandConfig(-1, 1500, 0, ROUND_ROBIN)
    assert c.band(3) == PriorityBandConfig(3, 1_000_000_000, 100, GLOBAL_STRICT)
    assert FlowControlConfig().band(0).fairness_policy == ROUND_ROBIN  # Sluice's default
    with pytest.raises(ValueError, match=r"'maxQueued'.*known fields: maxBytes, maxRequests"):
        FlowControlConfig.from_dict({"maxQueued": 10})
    with pytest.raises(ValueError, match=r"priorityBands\[0\]: unknown field 'ttl'"):
        FlowControlConfig.from_dict({"priorityBands": [{"priority": 1, "ttl": "1s"}]})
    with pytest.raises(ValueError, match="unknown policy 'fair'.*round-robin-fairness-policy"):
        FlowControlConfig.from_dict({"defaultPriorityBand": {"fairnessPolicyRef": "fair"}})
    with pytest.raises(ValueError, match="unknown policy 'edf-ordering-policy'"):
        FlowControlConfig.from_dict({"priorityBands": [
            {"priority": 1, "orderingPolicyRef": "edf-ordering-policy"}]})
    with pytest.raises(ValueError, match="a priority twice"):
        FlowControlConfig.from_dict({"priorityBands": [{"priority": 1}, {"priority": 1}]})
    with pytest.raises(ValueError, match="defaultRequestTTL"):
        FlowControlConfig.from_dict({"defaultRequestTTL": 30})  # Go wants "30s"
    with pytest.raises(ValueError, match="maxRequests"):
        FlowControlConfig.from_dict({"maxRequests": "lots"})
    with pytest.raises(ValueError, match="usageLimitPolicyPluginRef"):
        FlowControlConfig.from_dict({"usageLimitPolicyPluginRef": "adaptive"})
    assert FlowControlConfig.from_dict({"maxRequests": "100m"}).max_requests == 1  # rounds up


def test_metrics_count_every_outcome_once():
    async def scenario():
        fc, gate = controller(max_requests=1, default_request_ttl_s=0.5), Gate()
        await fc.admit(POOL, 1, "a", lambda p: False)                    # at once
        (waiter,) = await enqueue(fc, gate, [(1, "a")])                # queued, then out
        assert sample(fc, "inference_extension_flow_control_queue_size",
                      inference_pool=POOL, priority="1") == 1
        assert (await fc.admit(POOL, 1, "b", gate)).reason == "capacity"
        assert (await fc.admit(POOL, -3, "b", gate)).reason == "sheddable"
        gate.permits = 1
        fc.notify(POOL)
        await waiter
        return fc
    fc = run(scenario)
    hist = "inference_extension_flow_control_request_queue_duration_seconds_count"
    got = {o: sample(fc, hist, inference_pool=POOL, priority=p, outcome=o)
           for p, o in (("1", "Dispatched"), ("1", "RejectedCapacity"), ("-3", "RejectedOther"))}
    assert got == {"Dispatched": 2, "RejectedCapacity": 1, "RejectedOther": 1}
    assert sample(fc, "sluice_gateway_flow_dispatched_total", inference_pool=POOL,
                  priority="1") == 2
    assert sample(fc, "sluice_gateway_flow_shed_total", inference_pool=POOL, priority="-3",
                  reason="sheddable") == 1
    assert sample(fc, "inference_extension_flow_control_queue_size",
                  inference_pool=POOL, priority="1") == 0


def test_a_full_round_robin_band_evicts_the_flooding_tenants_newest():
    async def scenario():
        fc = controller(priority_bands=(PriorityBandConfig(priority=0, max_requests=4),))
        waiting = [asyncio.ensure_future(fc.admit(POOL, 0, "a", lambda p: True))
                   for _ in range(4)]
        await eventually(lambda: fc.queued(POOL) == 4, timeout=1, every_s=0.001)
        b = asyncio.ensure_future(fc.admit(POOL, 0, "b", lambda p: True))
        newest_a = await waiting[-1]  # a's newest made room for b's first
        assert isinstance(newest_a, Shed) and newest_a.reason == "evicted"
        assert fc.queued(POOL) == 4
        b2 = asyncio.ensure_future(fc.admit(POOL, 0, "b", lambda p: True))  # a 3, b 1
        await eventually(lambda: waiting[2].done(), timeout=1, every_s=0.001)
        assert waiting[2].result().reason == "evicted" and not waiting[1].done()
        got = await fc.admit(POOL, 0, "b", lambda p: True)  # a 2, b 2: b is refused
        assert isinstance(got, Shed) and got.reason == "capacity"
        assert fc.queued(POOL) == 4 and not b.done() and not b2.done()
        fc.check_invariants()
        await fc.close()
    run(scenario)


def test_usage_limits_hold_lower_priorities_back_first():
    static = FlowControlConfig(usage_threshold=0.8)
    assert static.ceiling(10) == static.ceiling(-5) == 0.8
    holdback = FlowControlConfig(holdback_min=0.6, priority_bands=(
        PriorityBandConfig(priority=10), PriorityBandConfig(priority=5),
        PriorityBandConfig(priority=0)))
    assert [holdback.ceiling(p) for p in (10, 5, 0)] == [1.0, 0.8, pytest.approx(0.6)]

    async def scenario():  # saturation 0.7: priority 10 and 5 pass, 0 waits
        fc = controller(holdback_min=0.6, priority_bands=holdback.priority_bands)
        sat = lambda p: 0.7 >= fc.config.ceiling(p)
        assert await fc.admit(POOL, 10, "a", sat) == Admitted(0.0)
        assert await fc.admit(POOL, 5, "a", sat) == Admitted(0.0)
        low = asyncio.ensure_future(fc.admit(POOL, 0, "a", sat))
        await eventually(lambda: fc.queued(POOL) == 1, timeout=1, every_s=0.001)
        assert not low.done()
        await fc.close()
    run(scenario)


def test_the_concurrency_detector_scores_in_flight_over_capacity():
    c = ConcurrencyDetectorConfig.from_dict({"maxConcurrency": 8, "concurrencyMode": "requests"})
    assert (c.score(12, 2), c.score(0, 0)) == (0.75, 1.0)
    with pytest.raises(ValueError, match="concurrencyMode"):
        ConcurrencyDetectorConfig.from_dict({"concurrencyMode": "tokens"})
    d = SaturationDetector(SaturationDetectorConfig())
    assert d.score([row(waiting=5, kv=0.4), row(waiting=0, kv=0.8)], NOW) == 1.0
    assert d.score([row(waiting=1, kv=0.4), None], NOW) == pytest.approx(0.75)
