"""Scheduler: one request's destination from a routing plan (`config.RoutingPlan`).

1. Candidates: the healthy pods of the request's pool not excluded, each with what
   the data layer knows of it: its load (the newer of its own scrape and Redis's
   entry, while fresh), this picker's in-flight requests and pending prefill tokens,
   its KV capacity, role, LoRA adapters, and its block size and key seed.
2. The plan's data producers fill what scorers read (the prefix producers: each
   candidate's predicted hits), once per request, over every candidate.
3. The plan's profile handler names the profiles to run, is shown their results, and
   names more until it names none (GIE's loop); each profile runs over the
   candidates (`profile.py`).
4. The handler's result names the primary profile (its target is the destination,
   its ranking the fallbacks, then the pods soft filters set aside) and, for a
   disaggregated request, the prefill profile (its target is named in
   `x-prefiller-host-port`, tried once: the decode engine prefills itself if that
   leg fails).
5. The plan's PreRequest hooks record each profile's result (prefix history,
   speculative index entries, session affinity).
A prefill pod is never the destination nor a fallback, whatever the plan says: it
is a KV producer and refuses to decode for a client.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.load.table import LoadTable
from sluice.gateway.prompt.block_keys import key_seed
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plan import RoutingPlan
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest


@dataclass(frozen=True)
class Decision:
    pod: str
    strategy: str                    # the routing plan's name
    hit_blocks: int
    total_blocks: int
    index_mode: str
    spec_keys: tuple[str, ...] = ()  # written as speculative entries (renewed in flight)
    prefill_tokens: int = 0          # the prompt's tokens the pod must compute
    fallbacks: tuple[str, ...] = ()  # the other healthy pods, best first (retries)


@dataclass(frozen=True)
class Route:
    decode: Decision                 # the destination (and its fallbacks)
    prefill: Decision | None = None  # the prefill pod's; None: the destination prefills
    outcome: str = "none"            # the profile handler's verdict (e.g. P/D's)


class PodView(Protocol):
    """What the scheduler reads about pods besides the load table."""

    def is_healthy(self, pod: str) -> bool: ...

    def inflight(self, pod: str) -> int:
        """Requests this picker has in flight to the pod."""

    def pending_prefill(self, pod: str) -> int:
        """Uncached prompt tokens sent to the pod whose answers have not begun."""

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's KV events (the index's keys were made with it)."""

    def key_model(self, pod: str, model: str) -> str | None:
        """The name the pod's KV events key a request for `model` with: its base
        model's first served name (so an alias hashes alike), a LoRA adapter's own
        name; None: `model`."""

    def role_of(self, pod: str) -> str | None: ...

    def index_mode(self) -> str:
        """Where prefix lookups are answered (redis / local / local_only / none)."""


class Scheduler:
    def __init__(self, plan: RoutingPlan, loads: LoadTable, pods: PodView) -> None:
        self.plan = plan
        self.loads = loads
        self.pods = pods

    async def schedule(self, req: RoutingRequest, pods: list[str],
                       exclude: frozenset[str] = frozenset()) -> Route | None:
        """The route of a request among `pods`, or None when no healthy pod can be
        the destination."""
        now = time.time() * 1000.0
        req.pool_roles = frozenset(self.pods.role_of(p) for p in pods)
        cands = [self._candidate(req, p, now) for p in pods
                 if p not in exclude and self.pods.is_healthy(p)]
        if not cands:
            return None
        plan = self.plan
        for producer in plan.producers:
            await producer.prepare(req, cands)
        results: dict[str, ProfileResult | None] = {}
        aside: dict[str, list[Candidate]] = {}
        while names := plan.handler.pick_profiles(req, plan.profiles, results):
            for name in names:
                assert name not in results, f"profile {name!r} ran twice"
                # (profiles only read the candidates: they share them)
                results[name], aside[name] = plan.profiles[name].run(req, cands)
        sched = plan.handler.process_results(req, results)
        target = sched.target
        if target is None or target.target.role == PREFILL:
            return None
        req.primary = sched.primary
        spec = {name: self._pre_request(req, name, r) for name, r in results.items()
                if r is not None}
        decode = self._decision(req, target, spec[sched.primary],
                                [c for c in (*target.ranked[1:], *aside[sched.primary])
                                 if c.role != PREFILL])
        prefill = None
        if sched.prefill is not None and (r := results.get(sched.prefill)) is not None:
            prefill = self._decision(req, r, spec[sched.prefill], [])
        return Route(decode, prefill, sched.outcome)

    def _candidate(self, req: RoutingRequest, pod: str, now_ms: float) -> Candidate:
        pods = self.pods
        bs = pods.block_size(pod) or self.plan.default_block_size
        n = len(req.token_ids)
        c = Candidate(pod, block_size=bs, prompt_tokens=n, total_blocks=n // bs,
                      key_group=(key_seed(pods.key_model(pod, req.model) or req.model,
                                          req.cache_salt), bs),
                      inflight=pods.inflight(pod), pending_prefill=pods.pending_prefill(pod),
                      role=pods.role_of(pod))
        row = self.loads.row(pod, now_ms)
        if row is not None:
            c.waiting, c.running, c.kv_usage = row["waiting"], row["running"], row["kv_usage"]
            c.load_ts_ms = row["ts_ms"]
        m = self.loads.metrics(pod)
        if m is not None:
            c.num_blocks = m.num_gpu_blocks
            c.running_loras, c.waiting_loras, c.max_loras = (
                m.running_loras, m.waiting_loras, m.max_loras)
        return c

    def _pre_request(self, req: RoutingRequest, profile: str,
                     result: ProfileResult) -> tuple[str, ...]:
        keys: tuple[str, ...] = ()
        for hook in self.plan.pre_request_hooks:
            keys += hook.pre_request(req, profile, result)
        return keys

    def _decision(self, req: RoutingRequest, result: ProfileResult, spec_keys: tuple[str, ...],
                  fallbacks: list[Candidate]) -> Decision:
        t = result.target
        # without a prompt (a plan that does not read it) the whole prompt is the pod's
        return Decision(t.pod, self.plan.name, t.hit_blocks, t.total_blocks,
                        self.pods.index_mode(), spec_keys, t.uncached_tokens,
                        tuple(dict.fromkeys(c.pod for c in fallbacks)))
