"""Keeps `sluice up`'s children running.

A child that exits is started again with the same command (same ports, so the
picker and Envoy find it where it was), after a backoff that doubles with each
restart in a row, from `base_s` up to `max_s`; a child that then runs for
`stable_s` starts the count again. Each exit and restart is logged with the exit
code and the restart count. Meanwhile the rest of the stack keeps serving: the
picker stops routing to a dead engine once its probes fail, and Envoy retries a
request that finds it gone on the next endpoint before the first byte.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from sluice.local.procs import Child


@dataclass
class _Record:
    started_at: float
    restarts: int = 0  # in all
    streak: int = 0  # in a row, without a stable run between
    due_at: float | None = None  # when the pending restart happens


class Supervisor:
    """Owned by the thread that calls `check` (the `sluice up` main loop)."""

    def __init__(self, out: TextIO = sys.stderr, base_s: float = 1.0, max_s: float = 30.0,
                 stable_s: float = 60.0) -> None:
        assert 0 < base_s <= max_s and stable_s > 0
        self.out, self.base_s, self.max_s, self.stable_s = out, base_s, max_s, stable_s
        self._records: dict[str, _Record] = {}

    def restarts(self, name: str) -> int:
        rec = self._records.get(name)
        return rec.restarts if rec is not None else 0

    def check(self, children: list[Child], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for child in children:
            rec = self._records.setdefault(child.name, _Record(started_at=now))
            if child.alive():
                if rec.streak and now - rec.started_at >= self.stable_s:
                    rec.streak = 0
                continue
            if rec.due_at is None:
                delay = min(self.max_s, self.base_s * 2 ** rec.streak)
                rec.due_at = now + delay
                self._say(f"{child.name} exited with {child.proc.returncode}; restarting it "
                          f"in {delay:g} s (restart {rec.restarts + 1})")
            elif now >= rec.due_at:
                child.restart()
                rec.restarts += 1
                rec.streak += 1
                rec.due_at = None
                rec.started_at = now
                self._say(f"{child.name} restarted (restart {rec.restarts})")

    def _say(self, line: str) -> None:
        print(f"sluice up: {line}", file=self.out, flush=True)
