"""Iteration-level scheduler: continuous batching with chunked prefill and preemption."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sched_policy import POLICIES, SchedulingPolicy


@dataclass
class SchedulerOutput:
    """Requests to run this step, each with how many of its tokens to compute."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefix_queries: int = 0  # tokens looked up in the prefix cache (first admissions)
    num_prefix_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass
class _Step:
    """What one `Scheduler.schedule` call has used and decided so far."""

    budget: int  # tokens left
    running_left: int  # requests running at the start not reached yet
    admitting: bool = True  # False once memory forced a preemption or a request did not fit
    in_prefill: set[int] = field(default_factory=set)  # block hashes being computed
    taken: set[str] = field(default_factory=set)  # waiting requests admitted or loading
    loras: set[int] = field(default_factory=set)  # adapters of running (and loading) requests
    served: set[str] = field(default_factory=set)
    first_prefill: Request | None = None

    def scheduled(self, req: Request, num_tokens: int, prefill: bool,
                  out: SchedulerOutput) -> None:
        out.scheduled.append((req, num_tokens))
        self.budget -= num_tokens
        self.served.add(req.request_id)
        if prefill and self.first_prefill is None:
            self.first_prefill = req


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy: SchedulingPolicy = POLICIES[config.policy]()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.kv_connector = None  # disaggregated prefill/decode (kv_transfer/): set by the engine
        self.lora = None  # multi-LoRA (lora/manager.py): set by the engine
        self._remote_loads: set[Request] = set()  # waiting for their KV from another engine

    def add(self, req: Request) -> None:
        assert req.num_tokens < self.max_model_len, "caller validates prompt length"
        self.policy.add(self.waiting, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self._has_remote_loads()

    def schedule(self) -> SchedulerOutput:
        # Policy, one step. The order of requests, the victims and who may preempt whom
        # come from the scheduling policy (sched_policy.py; fcfs: running requests oldest
        # first, then waiting ones in arrival order).
        # 1. A running request gets the tokens it still needs (1 for a decode, the rest of
        #    its prompt for a chunked prefill), capped by what is left of the step's token
        #    budget and by long_prefill_token_threshold.
        # 2. If the KV pool cannot cover a running request, preempt the policy's victim
        #    (free its blocks; it goes back to the waiting queue and recomputes later,
        #    usually hitting the prefix cache) until it fits. No waiting request is
        #    admitted after that in this step.
        # 3. A waiting request is admitted while budget, max_num_seqs and blocks allow
        #    (where the policy lets it outrank a running request, by preempting that one);
        #    the first that does not fit ends admissions for this step. It takes its cached
        #    prefix blocks, and chunks the rest of the prompt to the remaining budget (and
        #    the threshold), so a short prompt starts beside a long prefill, not after it.
        #    A waiting request whose first uncached block is one that a running (or just
        #    admitted) request is still computing stays waiting, without holding up the
        #    requests behind it: once that block is cached it is a hit, so computing it
        #    twice would only take budget from other requests (a burst of one prefix
        #    arriving while its first request's prefill is chunked).
        # LoRA: a waiting request whose adapter would be one more than --max-loras among
        # the running requests' ends admissions, as a full batch does (so it is next, never
        # starved); one whose adapter is not in host memory yet stays waiting, without
        # holding up the requests behind it, while the adapter is read in the background.
        # Speculative decoding: a decode with drafts (req.spec_token_ids) takes 1 + drafts
        # tokens of the budget; drafts that do not fit are dropped, and dropped before
        # anyone is preempted for their slots (`_num_draft_tokens`).
        out = SchedulerOutput()
        if self.kv_connector is not None:
            self._admit_loaded()
        step = _Step(self.config.max_num_batched_tokens, len(self.running))
        step.in_prefill = self._blocks_in_prefill(self.running) if self.waiting else set()
        if self.lora is not None:
            step.loras = {r.lora.lora_id for r in (*self.running, *self._remote_loads) if r.lora}
        for req, was_running in self.policy.order(self.running, self.waiting):
            if step.budget <= 0 or not (step.admitting or step.running_left):
                break
            if was_running:
                step.running_left -= 1
                if req.status is RequestStatus.RUNNING:  # (else preempted in this step)
                    self._schedule_running(req, step, out)
            elif step.admitting and not self.policy.defers(req, step.first_prefill):
                self._admit(req, step, out)
        if step.taken:
            self.waiting = deque(r for r in self.waiting if r.request_id not in step.taken)
        assert step.budget >= 0 and len(self.running) <= self.config.max_num_seqs
        return out

    def _schedule_running(self, req: Request, step: _Step, out: SchedulerOutput) -> None:
        num_new = self._chunk(req.num_tokens - req.num_computed_tokens, step.budget)
        assert num_new > 0, "a running request always has a token to compute"
        prefill = req.num_computed_tokens + num_new < req.num_tokens or num_new > 1
        if prefill and self.policy.defers(req, step.first_prefill):
            return
        num_draft = self._num_draft_tokens(req, num_new, step.budget)
        while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=num_draft):
            if num_draft:  # drafts are optional: drop them before preempting anyone
                num_draft = self._num_draft_tokens(req, num_new, 1)
                continue
            step.admitting = False
            if self._preempt_for(req, self.policy.victim(self.running), step, out):
                return
        step.scheduled(req, num_new + num_draft, prefill, out)

    def _admit(self, req: Request, step: _Step, out: SchedulerOutput) -> None:
        hits = self.kv.get_computed_blocks(req)
        if (step.in_prefill and len(hits) < (req.num_tokens - 1) // self.kv.block_size
                and req.block_hashes[len(hits)] in step.in_prefill):
            return  # its prefix is being computed: wait for it
        if req.lora is not None and not self._lora_admissible(req, step):
            return
        while len(self.running) >= self.config.max_num_seqs:
            if not self._outranked(req, step, out):
                step.admitting = False
                return
        if self.kv_connector is not None:
            loading = self._start_remote_load(req, hits)
            if loading is False:
                step.admitting = False  # no blocks for its load: wait, as for a prefill
                return
            if loading:
                step.taken.add(req.request_id)
                self._remote_loads.add(req)
                if req.lora is not None:
                    step.loras.add(req.lora.lora_id)
                return
        num_hit_tokens = len(hits) * self.kv.block_size
        num_new = self._chunk(req.num_tokens - num_hit_tokens, step.budget)
        while not self.kv.allocate_slots(req, num_new, hits):
            if not self._outranked(req, step, out):
                step.admitting = False
                return
        step.taken.add(req.request_id)
        if req.num_cached_tokens < 0:  # first admission: count prefix-cache stats
            req.num_cached_tokens = num_hit_tokens
            out.num_prefix_queries += req.num_tokens
            out.num_prefix_hits += num_hit_tokens
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        self.running.append(req)
        if req.lora is not None:
            step.loras.add(req.lora.lora_id)
        step.scheduled(req, num_new, True, out)
        step.in_prefill |= self._blocks_in_prefill([req])

    def _lora_admissible(self, req: Request, step: _Step) -> bool:
        if req.lora.lora_id not in step.loras and len(step.loras) >= self.lora.config.max_loras:
            step.admitting = False
            return False
        return self.lora.ready(req.lora, step.loras)

    def _outranked(self, req: Request, step: _Step, out: SchedulerOutput) -> bool:
        """Preempt the policy's victim for waiting `req` if req outranks it."""
        victim = self.policy.victim(self.running) if self.running else None
        if victim is None or not self.policy.outranks(req, victim):
            return False
        self._preempt_for(req, victim, step, out)
        return True

    def _preempt_for(self, req: Request, victim: Request, step: _Step,
                     out: SchedulerOutput) -> bool:
        """Preempt `victim` (never one served this step but `req` itself); whether it was
        `req`."""
        assert victim is req or victim.request_id not in step.served, "victim already served"
        self.running.remove(victim)
        self._preempt(victim)
        out.preempted.append(victim)
        return victim is req

    def _blocks_in_prefill(self, reqs: list[Request]) -> set[int]:
        """Hashes of the full blocks of `reqs` not computed yet (none without prefix
        caching: nothing can be shared then)."""
        if not self.kv.enable_prefix_caching:
            return set()
        bs = self.kv.block_size
        return {h for r in reqs
                for h in r.block_hashes[r.num_computed_tokens // bs: r.num_tokens // bs]}

    def _chunk(self, num_remaining: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold
        return min(num_remaining, budget, cap) if cap > 0 else min(num_remaining, budget)

    def _num_draft_tokens(self, req: Request, num_new: int, budget: int) -> int:
        """Speculative decoding: how many of req's drafts run this step after its one
        decode token (the budget counts them); the drafts that do not fit are dropped.
        Only a decode has drafts (the engine proposes after the request's last sample)."""
        if not req.spec_token_ids:
            return 0
        is_decode = num_new == 1 and req.num_computed_tokens + 1 == req.num_tokens
        req.spec_token_ids = req.spec_token_ids[:budget - num_new] if is_decode else []
        return len(req.spec_token_ids)

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance num_computed_tokens; return the requests that must sample a token now.

        A decode with drafts advances by its one known token here; the engine adds the
        drafts the target accepted once it has verified them (spec_decode/)."""
        sampling = []
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new - len(req.spec_token_ids)
            assert req.num_computed_tokens <= req.num_tokens
            if req.num_computed_tokens == req.num_tokens:
                sampling.append(req)
        return sampling

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._remote_loads.discard(req)
        if not self._connector_keeps_blocks(req):
            self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.policy.requeue(self.waiting, req)

    # -- KV connector hooks (disaggregated prefill/decode; the logic is in kv_transfer/) ----
    def _has_remote_loads(self) -> bool:
        return self.kv_connector is not None and self.kv_connector.has_pending_loads()

    def _start_remote_load(self, req: Request, hits: list[int]) -> bool | None:
        """A waiting request whose KV another engine holds: allocate its blocks (hashed only
        once loaded) and start the load. None: nothing to load, admit as usual; False: no
        blocks yet; True: loading (it waits in the connector, holding its blocks)."""
        num_hit_tokens = len(hits) * self.kv.block_size
        num_external, _ = self.kv_connector.get_num_new_matched_tokens(req, num_hit_tokens)
        if num_external == 0:
            return None
        if not self.kv.allocate_slots(req, num_external, hits, cache=False):
            return False
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        req.num_computed_tokens = num_hit_tokens
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_connector.update_state_after_alloc(req, self.kv.block_table(req.request_id),
                                                   num_external)
        return True

    def _admit_loaded(self) -> None:
        """Requests whose load ended join the running batch (a failed load leaves them
        their local hits: they prefill the rest as running requests)."""
        room = self.config.max_num_seqs - len(self.running)
        idle = not (self.waiting or self.running)
        for req in self.kv_connector.get_finished_loading(room, idle):
            self._remote_loads.discard(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)

    def _connector_keeps_blocks(self, req: Request) -> bool:
        """Whether the connector frees req's blocks itself later (held for a remote pull,
        or still being loaded into)."""
        if self.kv_connector is None:
            return False
        keep, _ = self.kv_connector.request_finished(req, self.kv.block_table(req.request_id))
        return keep
