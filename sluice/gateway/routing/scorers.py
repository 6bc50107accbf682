"""Scorers. The kv_aware score of a pod is

    score = w_prefix  * hit_blocks / total_blocks
          + w_prefill * (1 - prefill_cost / (max_prefill_cost + 1))
          + w_queue   * (1 - queue / (max_queue + 1))
          + w_kv      * (1 - kv_usage)
          + w_room    * (1 - held_blocks / num_blocks)

where prefill_cost = uncached tokens this gateway sent the pod that have not
produced a first token yet + this prompt's tokens the pod lacks (Dynamo's
"prefill left after the overlap credit"), queue = max(waiting + running from
the pod's load entry, this gateway's in-flight requests to it), and the maxima
are over the candidates. A pod whose load entry expired (unknown) is filtered
out while any pod's load is known (`UnknownLoadFilter`); if none is known, it
gets 0 for the queue and KV terms. held_blocks / num_blocks is how full the
pod's cache is with cached blocks, in use or not (the index's confirmed keys
for the pod over its `num_gpu_blocks`; 0 for the term while unknown): kv_usage
counts only blocks of running requests, so without this term new prefixes are
placed blind to the ones a pod already keeps, and a pod given more than its
cache holds evicts them. prefix (approximate) has no held counts, so it uses
the first four terms; least_load the queue and KV terms only. Higher is better.
"""

from __future__ import annotations

from typing import Protocol

from sluice.gateway.routing.candidate import Candidate


class Scorer(Protocol):
    def __call__(self, cands: list[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""


class PrefixScorer:
    def __call__(self, cands: list[Candidate]) -> list[float]:
        return [c.hit_blocks / c.total_blocks if c.total_blocks else 0.0 for c in cands]


class PrefillCostScorer:
    def __call__(self, cands: list[Candidate]) -> list[float]:
        top = max((c.prefill_cost for c in cands), default=0)
        return [1.0 - c.prefill_cost / (top + 1.0) for c in cands]


class QueueScorer:
    def __call__(self, cands: list[Candidate]) -> list[float]:
        top = max((c.queue for c in cands), default=0.0)
        return [1.0 - c.queue / (top + 1.0) if c.load_known else 0.0 for c in cands]


class KVUsageScorer:
    def __call__(self, cands: list[Candidate]) -> list[float]:
        return [1.0 - min(max(c.kv_usage, 0.0), 1.0) if c.kv_usage is not None else 0.0
                for c in cands]


class CacheRoomScorer:
    def __call__(self, cands: list[Candidate]) -> list[float]:
        return [c.cache_room or 0.0 for c in cands]


def weighted(cands: list[Candidate], parts: list[tuple[float, Scorer]]) -> list[float]:
    """Sum of weight * scorer(cands) over `parts`."""
    total = [0.0] * len(cands)
    for weight, scorer in parts:
        if weight:
            for i, s in enumerate(scorer(cands)):
                total[i] += weight * s
    return total
