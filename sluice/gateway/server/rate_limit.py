"""Per-key limits on requests and tokens per minute, shared by every picker replica.

Each admitted request adds 1 to its key's request count and its cost to its token
count, in a window of one wall-clock minute kept in Redis (`sluice:rl:{name}:{minute}`,
expiring after two minutes), so all replicas count together. A request that would
pass either limit is refused (429, Retry-After = the seconds left in the minute) and
counted nowhere: the check and the count are one script, atomic across replicas. A request is counted once, where the picker sees it: Envoy's retries on
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


# KEYS[1] the window; ARGV: requests/min, tokens/min (0: none), this request's cost.
_ADMIT = """
local req = tonumber(redis.call('HGET', KEYS[1], 'req') or '0')
local tok = tonumber(redis.call('HGET', KEYS[1], 'tok') or '0')
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if (rpm > 0 and req + 1 > rpm) or (tpm > 0 and tok + cost > tpm) then return 0 end
redis.call('HINCRBY', KEYS[1], 'req', 1)
redis.call('HINCRBY', KEYS[1], 'tok', cost)
redis.call('EXPIRE', KEYS[1], 120)
return 1
"""


class RateLimiter:
    """Used on the event loop only."""

    def __init__(self, limits: Limits, redis_aio=None, timeout_s: float = 0.05) -> None:
        self.limits, self.redis, self.timeout_s = limits, redis_aio, timeout_s
        self._script = redis_aio.register_script(_ADMIT) if redis_aio is not None else None
        self._local: dict[tuple[str, int], list[int]] = {}
        self._warned = False

    async def admit(self, name: str, tokens: int, now: float | None = None) -> int | None:
        """None: admitted (and counted); else the seconds to wait (Retry-After)."""
        if not self.limits.any:
            return None
        now = time.time() if now is None else now
        minute = int(now // 60)
        if not await self._admit(name, minute, tokens):
            return max(1, math.ceil((minute + 1) * 60 - now))
        return None

    async def _admit(self, name: str, minute: int, cost: int) -> bool:
        rpm, tpm = self.limits.requests_per_minute, self.limits.tokens_per_minute
        if self._script is not None:
            try:
                admitted = await asyncio.wait_for(
                    self._script(keys=[f"{PREFIX}rl:{name}:{minute}"], args=[rpm, tpm, cost]),
                    self.timeout_s)
                return bool(admitted)
            except (RedisError, OSError, TimeoutError) as err:
                if not self._warned:
                    self._warned = True
                    log.warning("rate limits: Redis unavailable (%s); counting on this "
                                "replica alone until it answers", err)
        for old in [k for k in self._local if k[1] < minute]:
            del self._local[old]
        row = self._local.setdefault((name, minute), [0, 0])
        if (rpm and row[0] + 1 > rpm) or (tpm and row[1] + cost > tpm):
            return False
        row[0] += 1
        row[1] += cost
        return True
