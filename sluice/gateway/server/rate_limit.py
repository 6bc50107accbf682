"""Per-key limits on requests and tokens per minute, shared by every picker replica.

Each admitted request adds 1 to its key's request count and its tokens (the
prompt's, plus the `max_tokens` it asks for: what it may cost) to its token count,
in a window of one wall-clock minute kept in Redis (`sluice:rl:{name}:{minute}`,
one HINCRBY pipeline, expiring after two minutes), so all replicas count
together. Over either limit: 429 with Retry-After = the seconds left in the
minute. A request is counted once, where the picker sees it: Envoy's retries on
fallback endpoints never come back to the picker. Without Redis, or when it does
not answer within `timeout_s`, each replica counts alone (and says so once).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from sluice.index_keys import PREFIX

log = logging.getLogger("sluice.gateway.keys")


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0

    def __post_init__(self) -> None:
        assert self.requests_per_minute >= 0 and self.tokens_per_minute >= 0

    @property
    def any(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)


class RateLimiter:
    """Used on the event loop only."""

    def __init__(self, limits: Limits, redis_aio=None, timeout_s: float = 0.05) -> None:
        self.limits, self.redis, self.timeout_s = limits, redis_aio, timeout_s
        self._local: dict[tuple[str, int], list[int]] = {}
        self._warned = False

    async def admit(self, name: str, tokens: int, now: float | None = None) -> int | None:
        """None: admitted (and counted); else the seconds to wait (Retry-After)."""
        if not self.limits.any:
            return None
        now = time.time() if now is None else now
        minute = int(now // 60)
        counts = await self._count(name, minute, tokens)
        retry_after = max(1, math.ceil((minute + 1) * 60 - now))
        rpm, tpm = self.limits.requests_per_minute, self.limits.tokens_per_minute
        if (rpm and counts[0] > rpm) or (tpm and counts[1] > tpm):
            return retry_after
        return None

    async def _count(self, name: str, minute: int, tokens: int) -> tuple[int, int]:
        if self.redis is not None:
            key = f"{PREFIX}rl:{name}:{minute}"
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.hincrby(key, "req", 1).hincrby(key, "tok", tokens).expire(key, 120)
                req, tok, _ = await asyncio.wait_for(pipe.execute(), self.timeout_s)
                return int(req), int(tok)
            except (RedisError, OSError, TimeoutError) as err:
                if not self._warned:
                    self._warned = True
                    log.warning("rate limits: Redis unavailable (%s); counting on this "
                                "replica alone until it answers", err)
        for old in [k for k in self._local if k[1] < minute]:
            del self._local[old]
        row = self._local.setdefault((name, minute), [0, 0])
        row[0] += 1
        row[1] += tokens
        return row[0], row[1]
