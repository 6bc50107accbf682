"""A scheduling profile: filters, then a weighted sum of scorers, then a picker.

`run` over a request's candidates (the healthy pods of its pool):
1. each filter in the configured order keeps a sub-list. A soft filter (load and
   capacity filters) never keeps none: it returns its input instead, and the pods it
   set aside stay usable as the last fallbacks (better an overloaded pod than none). A
   hard filter (the role filters) may keep none: then the profile has no result;
2. score = sum over scorers of weight x scorer (each in [0, 1]);
3. the picker orders the survivors: its first is the target, the rest its fallbacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugins import (
    Filter,
    Picker,
    ProfileResult,
    RoutingRequest,
    Scorer,
)


@dataclass
class SchedulingProfile:
    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[float, Scorer]] = field(default_factory=list)
    picker: Picker | None = None  # None only until the configuration is complete

    def __post_init__(self) -> None:
        assert all(w >= 0 for w, _ in self.scorers), self.scorers

    def run(self, req: RoutingRequest, cands: list[Candidate]
            ) -> tuple[ProfileResult | None, list[Candidate]]:
        """(The result, or None when a hard filter left no candidate; the pods the
        soft filters set aside, the first filter's first)."""
        assert self.picker is not None, f"profile {self.name!r} has no picker"
        aside: list[Candidate] = []
        for f in self.filters:
            kept = f.filter(req, cands)
            if not getattr(f, "hard", False):
                assert kept, f"soft filter {f.name!r} kept no candidate"
                ids = {id(c) for c in kept}
                aside.extend(c for c in cands if id(c) not in ids)
            cands = kept
            if not cands:
                return None, []
        scores = [0.0] * len(cands)
        for weight, scorer in self.scorers:
            if weight:
                for i, s in enumerate(scorer.score(req, cands)):
                    scores[i] += weight * s
        order = self.picker.pick(req, cands, scores)
        assert sorted(order) == list(range(len(cands))), (self.picker.name, order)
        cold = all(c.hit_blocks == 0 for c in cands)
        return (ProfileResult(tuple(cands[i] for i in order), tuple(scores[i] for i in order),
                              cold), aside)
