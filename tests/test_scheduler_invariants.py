"""Block-manager and scheduler invariants under random workloads (no model: tokens are random)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler

workload = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "num_blocks": st.integers(8, 64),
    "budget": st.integers(1, 96),
    "threshold": st.sampled_from([0, 0, 1, 3, 8, 24]),
    "max_num_seqs": st.integers(1, 8),
    "num_requests": st.integers(1, 12),
    "abort_rate": st.floats(0.0, 0.2),
    "prefix_caching": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority"]),
})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workload_keeps_invariants(w):
    rng = random.Random(w["seed"])
    bs = w["block_size"]
    kv = KVCacheManager(w["num_blocks"], bs, w["prefix_caching"])
    max_model_len = w["num_blocks"] * bs
    sched = Scheduler(SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                      max_num_batched_tokens=w["budget"],
                                      long_prefill_token_threshold=w["threshold"],
                                      policy=w["policy"]),
                      kv, max_model_len)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    live: dict[str, Request] = {}
    finished: set[str] = set()
    for i in range(w["num_requests"]):
        prompt = (rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randint(0, 20))])
        prompt = prompt[: max_model_len - 1] or [1]
        max_tokens = rng.randint(1, 20)
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens),
                      priority=rng.choice([0, 0, 1, 5]))
        live[req.request_id] = req
        sched.add(req)

    for _ in range(5000):
        if not sched.has_unfinished():
            break
        if live and rng.random() < w["abort_rate"]:
            rid = rng.choice(sorted(live))
            sched.finish(live.pop(rid))
            finished.add(rid)
        out = sched.schedule()
        assert out.num_tokens <= w["budget"]
        assert len(sched.running) <= w["max_num_seqs"]
        assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled)
        for req, n in out.scheduled:
            table = kv.block_table(req.request_id)
            assert len(table) * bs >= req.num_computed_tokens + n, "slots missing for the step"
            assert req.num_computed_tokens + n <= req.num_tokens
            assert n <= (w["threshold"] or n), "long_prefill_token_threshold caps each chunk"
        for req in out.preempted:
            assert req.num_computed_tokens == 0 and not kv.block_table(req.request_id)
            assert req in sched.waiting and req not in sched.running
        assert not {r.request_id for r in sched.waiting} & {r.request_id for r in sched.running}
        if w["policy"] == "priority":  # the queue stays in (priority, arrival) order
            keys = [(r.priority, r.arrival_time) for r in sched.waiting]
            assert keys == sorted(keys)
        if w["prefix_caching"]:  # no block that could be a hit is computed twice at once
            touched = [h for req, n in out.scheduled
                       for h in req.block_hashes[req.num_computed_tokens // bs:
                                                 min(-(-(req.num_computed_tokens + n) // bs),
                                                     (req.num_tokens - 1) // bs)]]
            assert len(touched) == len(set(touched)), "two requests compute one block"
        kv.check_invariants()
        for req in sched.update_after_step(out):
            req.token_ids.append(rng.randrange(100))
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= max_model_len:
                req.finish("length")
                sched.finish(req)
                live.pop(req.request_id)
                finished.add(req.request_id)
        kv.check_invariants()
        held = set().union(*(kv.block_table(r.request_id) for r in sched.running))
        assert len(held) + kv.num_free_blocks == kv.num_blocks
    assert not sched.has_unfinished(), "every request finishes or is aborted"
    assert finished == {f"r{i}" for i in range(w["num_requests"])}
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    kv.check_invariants()


def test_prefix_hit_revives_free_cached_blocks():
    kv = KVCacheManager(8, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 32)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1))
    sched.add(a)
    out = sched.schedule()
    sched.update_after_step(out)
    sched.finish(a)
    assert kv.num_free_blocks == 8 and len(kv.cached) == 2  # two full blocks stay cached
    b = Request("b", list(range(9)) + [99], SamplingParams(max_tokens=1))
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and out.scheduled == [(b, 2)]
    assert out.num_prefix_hits == 8 and out.num_prefix_queries == 10
    kv.check_invariants()


def test_long_prefill_threshold_lets_a_short_prompt_start_beside_a_long_one():
    def first_steps(threshold):
        kv = KVCacheManager(64, 4, True)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100,
                                          long_prefill_token_threshold=threshold), kv, 256)
        long, short = (Request("long", list(range(200)), SamplingParams(max_tokens=1)),
                       Request("short", list(range(500, 510)), SamplingParams(max_tokens=1)))
        sched.add(long)
        sched.add(short)
        steps = []
        for _ in range(2):
            out = sched.schedule()
            steps.append([(r.request_id, n) for r, n in out.scheduled])
            for req in sched.update_after_step(out):
                req.token_ids.append(7)
        return steps

    assert first_steps(0) == [[("long", 100)], [("long", 100)]], "no cap: the long one takes all"
    assert first_steps(32) == [[("long", 32), ("short", 10)], [("long", 32), ("short", 1)]]


def test_a_request_waits_for_the_prefix_another_one_is_computing():
    kv = KVCacheManager(16, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64,
                                      long_prefill_token_threshold=4), kv, 64)
    prefix = list(range(16))
    a, b, c = (Request("a", prefix, SamplingParams(max_tokens=1)),
               Request("b", prefix + [90, 91], SamplingParams(max_tokens=1)),
               Request("c", list(range(50, 56)), SamplingParams(max_tokens=1)))
    sched.add(a)
    steps = []
    for i in range(4):
        if i == 1:
            sched.add(b)  # same prefix, while a's prefill is chunked
            sched.add(c)  # another prompt behind it is not held up
        out = sched.schedule()
        steps.append([(r.request_id, n) for r, n in out.scheduled])
        for req in sched.update_after_step(out):
            req.token_ids.append(7)
            req.finish("length")
            sched.finish(req)
    # b starts in the step that computes a's last block: blocks count as cached from
    # the step that writes them (each layer writes its K/V before attending)
    assert steps[:4] == [[("a", 4)], [("a", 4), ("c", 4)], [("a", 4), ("c", 2)],
                         [("a", 4), ("b", 2)]]
    assert b.num_cached_tokens == 16, "b found a's whole prefix cached"
    kv.check_invariants()


def test_lru_eviction_emits_events():
    kv = KVCacheManager(4, 2, True, record_events=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 8)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    sched.add(a)
    sched.update_after_step(sched.schedule())
    sched.finish(a)
    stored = kv.take_events()
    assert len(stored) == 1 and stored[0].token_ids == [1, 2, 3, 4]
    assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) == 2
    b = Request("b", [7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=1))
    sched.add(b)
    sched.schedule()
    events = kv.take_events()
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert set(removed) == set(stored[0].block_hashes), "b needed every block: a's were evicted"


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(16, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 64)

    def admit(rid, salt):
        r = Request(rid, list(range(12)), SamplingParams(max_tokens=1), cache_salt=salt)
        sched.add(r)
        sched.update_after_step(sched.schedule())
        sched.finish(r)
        return r.num_cached_tokens

    assert admit("a", "tenant-1") == 0
    assert admit("b", "tenant-2") == 0, "another salt must not hit tenant-1's blocks"
    assert admit("c", "tenant-1") == 8
    assert admit("d", None) == 0
    kv.check_invariants()
