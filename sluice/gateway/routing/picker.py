"""Picker: the highest score; near-ties broken at random (seeded), which spreads
cold requests (no prefix hit anywhere) over equally loaded pods."""

from __future__ import annotations

import random

from sluice.gateway.routing.candidate import Candidate


class MaxScorePicker:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def __call__(self, cands: list[Candidate], scores: list[float],
                 tolerance: float = 1e-9) -> Candidate:
        assert cands and len(cands) == len(scores)
        best = max(scores)
        tied = [c for c, s in zip(cands, scores) if s >= best - tolerance]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
