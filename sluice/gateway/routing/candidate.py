"""What routing knows about one pod for one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Candidate:
    pod: str
    hit_blocks: int = 0              # leading prompt blocks the pod holds (predicted)
    total_blocks: int = 0            # full blocks in the prompt (for that pod's block size)
    waiting: float | None = None     # None: no fresh load entry (unknown)
    running: float | None = None
    kv_usage: float | None = None
    inflight: int = 0                # requests this gateway has in flight to the pod
    pending_prefill: int = 0         # uncached prompt blocks this gateway sent to the pod
                                     # whose first token has not come back yet
    held_blocks: int = 0             # blocks the pod's cache holds (index, confirmed)
    num_blocks: int | None = None    # the pod's KV-cache capacity in blocks (None: unknown)

    @property
    def prefill_cost(self) -> int:
        """Blocks the pod must prefill before this request's first token: what it
        already owes this gateway plus this prompt's uncached blocks."""
        return self.pending_prefill + max(self.total_blocks - self.hit_blocks, 0)

    @property
    def cache_room(self) -> float | None:
        """Fraction of the pod's cache not holding cached blocks (None: unknown)."""
        if not self.num_blocks:
            return None
        return 1.0 - min(self.held_blocks / self.num_blocks, 1.0)

    @property
    def load_known(self) -> bool:
        return self.waiting is not None

    @property
    def queue(self) -> float:
        """Requests ahead of a new one: the larger of the scraped and the local count
        (the local one reacts immediately, the scraped one sees other gateways)."""
        scraped = (self.waiting or 0.0) + (self.running or 0.0)
        return max(scraped, float(self.inflight))
