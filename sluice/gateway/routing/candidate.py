"""What routing knows about one pod for one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Candidate:
    pod: str
    hit_blocks: int = 0              # leading prompt blocks the pod would reuse (predicted)
    total_blocks: int = 0            # full blocks in the prompt (for that pod's block size)
    block_size: int = 16             # the pod's, in tokens
    key_group: tuple[str, int] = ("", 16)  # (key seed, block size) of its request keys
    prompt_tokens: int = 0
    waiting: float | None = None     # None: no fresh load entry (unknown)
    running: float | None = None
    kv_usage: float | None = None
    load_ts_ms: float = 0.0          # when the load above was measured
    inflight: int = 0                # requests this gateway has in flight to the pod
    pending_prefill: int = 0         # uncached prompt tokens this gateway sent to the pod
                                     # whose first token has not come back yet
    held_blocks: int = 0             # blocks the pod's cache holds (index, confirmed)
    num_blocks: int | None = None    # the pod's KV-cache capacity in blocks (None: unknown)
    role: str | None = None          # prefill, decode, both or None (`discovery.static`)
    running_loras: frozenset[str] = frozenset()  # adapters of its running requests
    waiting_loras: frozenset[str] = frozenset()  # adapters of its waiting requests
    max_loras: int | None = None     # adapters it runs in one batch (None: unknown)

    @property
    def uncached_tokens(self) -> int:
        """This prompt's tokens the pod must compute."""
        return max(self.prompt_tokens - self.hit_blocks * self.block_size, 0)

    @property
    def prefill_cost(self) -> int:
        """Tokens the pod must prefill before this request's first token: what it
        already owes this gateway plus this prompt's uncached tokens (in tokens, so
        pods with different block sizes compare alike)."""
        return self.pending_prefill + self.uncached_tokens

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
