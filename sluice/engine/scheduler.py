"""Iteration-level scheduler: continuous batching with chunked prefill and preemption."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from sluice.engine.config import SchedulerConfig
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.request import Request, RequestStatus


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.kv_connector = None  # disaggregated prefill/decode (kv_transfer/): set by the engine

    def add(self, req: Request) -> None:
        assert req.num_tokens < self.max_model_len, "caller validates prompt length"
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running) or self._has_remote_loads()

    def schedule(self) -> SchedulerOutput:
        # Policy, one step:
        # 1. Running requests first, oldest first: each gets the tokens it still needs
        #    (1 for a decode, the rest of its prompt for a chunked prefill), capped by
        #    what is left of the step's token budget and by long_prefill_token_threshold.
        # 2. If the KV pool cannot cover a running request, preempt the newest running
        #    request (free its blocks; it goes back to the front of the waiting queue and
        #    recomputes later, usually hitting the prefix cache) until it fits.
        # 3. Then admit waiting requests in arrival order while budget, max_num_seqs and
        #    blocks allow (none after a preemption in this step): take their cached prefix
        #    blocks, and chunk the rest of the prompt to the remaining budget (and the
        #    threshold), so a short prompt starts beside a long prefill, not after it.
        #    A waiting request whose first uncached block is one that a running (or just
        #    admitted) request is still computing stays waiting, without holding up the
        #    requests behind it: once that block is cached it is a hit, so computing it
        #    twice would only take budget from other requests (a burst of one prefix
        #    arriving while its first request's prefill is chunked).
        # Speculative decoding: a decode with drafts (req.spec_token_ids) takes 1 + drafts
        # tokens of the budget; drafts that do not fit are dropped, and dropped before
        # anyone is preempted for their slots (`_num_draft_tokens`).
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.kv_connector is not None:
            self._admit_loaded()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, "a running request always has a token to compute"
            num_draft = self._num_draft_tokens(req, num_new, budget)
            while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=num_draft):
                if num_draft:  # drafts are optional: drop them before preempting anyone
                    num_draft = self._num_draft_tokens(req, num_new, 1)
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new + num_draft))
                budget -= num_new + num_draft
                i += 1
        in_prefill = self._blocks_in_prefill(self.running) if self.waiting else set()
        j = 0
        while (j < len(self.waiting) and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[j]
            hits = self.kv.get_computed_blocks(req)
            if (in_prefill and len(hits) < (req.num_tokens - 1) // self.kv.block_size
                    and req.block_hashes[len(hits)] in in_prefill):
                j += 1  # its prefix is being computed: wait for it
                continue
            if self.kv_connector is not None:
                loading = self._start_remote_load(req, hits)
                if loading is False:
                    break  # no blocks for its load: wait, as for a prefill
                if loading:
                    del self.waiting[j]
                    continue
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = self._chunk(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            del self.waiting[j]
            if req.num_cached_tokens < 0:  # first admission: count prefix-cache stats
                req.num_cached_tokens = num_hit_tokens
                out.num_prefix_queries += req.num_tokens
                out.num_prefix_hits += num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
            in_prefill |= self._blocks_in_prefill([req])
        assert budget >= 0 and len(self.running) <= self.config.max_num_seqs
        return out

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
        if not self._connector_keeps_blocks(req):
            self.kv.free(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

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
