"""The priority scheduling policy (sched_policy.Priority, `--scheduling-policy priority`),
step by step, against FCFS on the same requests."""

from __future__ import annotations

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler

BS = 4


def make(policy: str, *, blocks: int = 64, seqs: int = 8, budget: int = 256,
         threshold: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                     long_prefill_token_threshold=threshold, policy=policy),
                     KVCacheManager(blocks, BS, True), blocks * BS)


def req(name: str, n: int, priority: int = 0, arrival: float = 0.0) -> Request:
    base = 1000 * (ord(name[0]) - ord("a") + 1)  # distinct prompts: no prefix hits
    return Request(name, list(range(base, base + n)), SamplingParams(max_tokens=100),
                   arrival_time=arrival, priority=priority)


def step(s: Scheduler) -> list[tuple[str, int]]:
    out = s.schedule()
    for r in s.update_after_step(out):
        r.token_ids.append(7)
    return [(r.request_id, n) for r, n in out.scheduled]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    got = {}
    for policy in ("fcfs", "priority"):
        s = make(policy, seqs=2)
        for r in (req("a", 4, 5, 1.0), req("b", 4, 0, 2.0), req("c", 4, 0, 3.0),
                  req("d", 4, 0, 0.5)):
            s.add(r)
        got[policy] = step(s)
    assert got["fcfs"] == [("a", 4), ("b", 4)]
    assert got["priority"] == [("d", 4), ("b", 4)]


def test_a_higher_priority_request_takes_a_seat_from_a_lower_one_never_an_equal_one():
    s = make("priority", seqs=2)
    low, mid = req("a", 4, 5, 1.0), req("b", 4, 1, 2.0)
    s.add(low)
    assert step(s) == [("a", 4)]
    s.add(mid)
    assert step(s) == [("b", 4), ("a", 1)]
    s.add(req("c", 4, 5, 3.0))
    assert step(s) == [("b", 1), ("a", 1)], "an equal priority waits for a seat"
    s.add(req("d", 4, 0, 4.0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["a"]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("d", 4), ("b", 1)]
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["a", "c"], "a arrived first"


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make("fcfs", seqs=1)
    s.add(req("a", 4, 5, 1.0))
    step(s)
    s.add(req("b", 4, 0, 2.0))
    out = s.schedule()
    assert not out.preempted and [r.request_id for r, _ in out.scheduled] == ["a"]


def test_memory_pressure_preempts_the_lowest_priority_not_the_newest():
    got = {}
    for policy in ("fcfs", "priority"):
        s = make(policy, blocks=4)  # 4 blocks of 4 tokens
        s.add(req("b", 4, 9, 1.0))
        step(s)
        s.add(req("a", 4, 0, 2.0))
        s.add(req("c", 4, 0, 3.0))
        step(s)  # b's fifth token takes a second block, a and c one each: all 4
        out = s.schedule()  # a and c need a second block each
        got[policy] = [r.request_id for r in out.preempted]
    assert got == {"fcfs": ["c"], "priority": ["b"]}


def test_a_prefill_keeps_lower_priority_prompt_tokens_out_of_its_step_not_their_decodes():
    s = make("priority", threshold=8)
    s.add(req("a", 4, 5, 1.0))
    s.add(req("b", 40, 5, 2.0))
    assert step(s) == [("a", 4), ("b", 8)]
    s.add(req("c", 12, 0, 3.0))
    assert step(s) == [("c", 8), ("a", 1)], "b's prompt waits; a's decode goes on"
    assert step(s) == [("c", 4), ("a", 1)]
    assert step(s) == [("c", 1), ("a", 1), ("b", 8)], "c decodes: b's prefill resumes"
    f = make("fcfs", threshold=8)
    for r in (req("a", 4, 5, 1.0), req("b", 40, 5, 2.0)):
        f.add(r)
    step(f)
    f.add(req("c", 12, 0, 3.0))
    assert step(f) == [("a", 1), ("b", 8), ("c", 8)]


def test_a_preempted_request_returns_in_priority_order():
    s = make("priority", seqs=1)
    s.add(req("a", 4, 3, 1.0))
    step(s)
    s.add(req("b", 4, 3, 2.0))
    s.add(req("c", 4, 0, 3.0))
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["a"]
    # a arrived before b: at equal priority it comes back first
    assert [r.request_id for r in s.waiting] == ["a", "b"]
