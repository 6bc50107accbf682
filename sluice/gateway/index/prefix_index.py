"""The prefix index one gateway replica routes on: Redis, with a local fallback.

`PrefixIndex` writes every event batch to its bounded `LocalIndex` and, while
Redis answers, to the shared `RedisIndex`. When a Redis call fails it switches
to local mode (logged, and exported as `sluice_gateway_index_mode`), keeps
routing on the local view, and marks every pod for re-sync; `recover()` (run
by the event feeder between batches) pings Redis and, once it answers,
rewrites each pod's entries in Redis from the local view at the pod's last
applied sequence number (unless Redis holds as much: `redis_rewrite`), then
switches back. A pod whose local view may lack entries (its feed started past
the engine's first batch, had a gap the engine's replay could not fill, or
skipped a batch) is merged into Redis instead: its view's entries are added,
none removed, since Redis may hold what the view missed. A Redis that lost its data (restarted empty: its epoch key,
`index_keys.EPOCH_KEY`, is gone or another) is treated as an outage: the loss
shows in the next batch's APPLY or within `recover_every_s` (`check_epoch`),
and the recovery rewrites every pod from the local view.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

from redis.exceptions import RedisError

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.redis_apply import Outcome, encode_ops
from sluice.gateway.index.redis_index import RedisIndex
from sluice.gateway.index.spec_writer import SpeculationWriter
from sluice.index_keys import purge_pods

log = logging.getLogger("sluice.gateway.index")


class Found(NamedTuple):
    hits: dict[str, int]                       # pod -> leading keys held
    loads: dict[str, dict[str, float]] | None  # Redis load entries (None: not read)
    held: dict[str, int]                       # pod -> keys held (confirmed)


def now_ms() -> float:
    return time.time() * 1000.0


class PrefixIndex:
    MAX_SLOW_LOOKUPS = 5

    def __init__(self, local: LocalIndex, redis: RedisIndex | None,
                 lookup_timeout_s: float = 0.05, flush_after_s: float = 0.01,
                 read_local: bool = False) -> None:
        """`flush_after_s`: how long speculative entries are batched before they
        are written to Redis (see `speculate`). `read_local`: lookups read the
        local view even while Redis answers (no Redis round trip per request:
        the other replicas' speculative entries reach the view through
        `spec_mirror`, Redis's loads through the load scraper); Redis is still
        written, for the other replicas and the operator."""
        assert lookup_timeout_s > 0 and flush_after_s > 0
        self.local = local
        self.redis = redis
        self.read_local = read_local
        self.lookup_timeout_s = lookup_timeout_s
        self.flush_after_s = flush_after_s
        # (a slow flush only counts toward an outage: only a lookup in time resets it)
        self._writer = (SpeculationWriter(redis, flush_after_s, lookup_timeout_s * 4,
                                          self._timed_out, self._degrade)
                        if redis is not None else None)
        self._lock = threading.Lock()
        self._degraded = redis is None
        self._slow = 0  # consecutive lookup timeouts
        self._position: dict[str, tuple[int, float]] = {}  # pod -> last applied (seq, ts)
        self._purge_later: set[str] = set()  # pods forgotten while Redis was down
        # pods that restarted while Redis was down: their purge guard (see restarted)
        self._restarted_later: dict[str, tuple[float, tuple[int, float]]] = {}
        self._block_size: dict[str, int] = {}
        self._partial: set[str] = set()  # pods whose local view may lack entries
        self._epoch: str | None = None  # Redis's epoch this replica fed (None: not read yet)
        self.on_mode_change: list[Any] = []

    def block_size(self, pod: str) -> int | None:
        """The block size of the pod's events (None: none seen yet)."""
        return self._block_size.get(pod)

    @property
    def mode(self) -> str:
        """"redis" (shared index), "local" (Redis down: fallback) or "local_only"."""
        if self.redis is None:
            return "local_only"
        return "local" if self._degraded else "redis"

    def _degrade(self, err: Exception) -> None:
        with self._lock:
            if self._degraded:
                return
            self._degraded = True
        log.warning("redis unreachable (%s): routing on the local index view until it returns",
                    err)
        for cb in self.on_mode_change:
            cb(self.mode)

    # -- feeder thread -------------------------------------------------------------------
    def apply(self, pod: str, seq: int, stored: list[tuple[str, str]], removed: list[str],
              cleared: bool, block_size: int | None, ts: float = 0.0,
              complete: bool = True) -> None:
        """Apply one event batch of `pod` (already translated to request keys);
        `complete`: it follows the pod's last applied batch (or is its engine's
        first), so the view holds every batch so far unless one was missed before."""
        if cleared:
            self.local.clear(pod)
            self._partial.discard(pod)  # (the view starts again from this batch)
        elif not complete:
            self.mark_partial(pod)
        if stored:
            self.local.store(pod, stored)
        if removed:
            self.local.remove(pod, removed)
        self._position[pod] = (seq, ts)
        if block_size is not None:
            self._block_size[pod] = block_size
        if self.redis is None or self._degraded:
            return
        try:
            if self._epoch is None:
                self._epoch = self.redis.epoch()
            ops = encode_ops(stored, removed, cleared, block_size)
            outcome = self.redis.apply(pod, seq, ops, ts, self._epoch)
            if outcome is Outcome.RESYNC:
                log.warning("%s: a rewrite of its entries in redis was abandoned half-way: "
                            "re-syncing them", pod)
                self._resync(pod)
            elif outcome is Outcome.LOST:
                self._lost()
        except RedisError as err:
            self._degrade(err)

    def check_epoch(self) -> None:
        """(Feeder thread, while in redis mode) notice a Redis that lost its data
        even when no event batch comes to show it."""
        if self.redis is None or self._degraded:
            return
        try:
            epoch = self.redis.epoch()
        except RedisError as err:
            self._degrade(err)
            return
        if self._epoch is None:
            self._epoch = epoch
        elif epoch != self._epoch:
            self._lost()

    def _lost(self) -> None:
        self._degrade(RedisError("redis lost the index (restarted empty?): every pod is "
                                 "re-synced from this replica's view"))

    def mark_partial(self, pod: str) -> None:
        """The pod's view missed some of its batches (see the module docstring)."""
        if pod not in self._partial:
            self._partial.add(pod)
            log.warning("%s: its local view missed event batches: a re-sync will add its "
                        "entries to redis, not replace them", pod)

    def _resync(self, pod: str) -> bool:
        """Rewrite the pod's entries in Redis from the local view unless Redis is as
        current (`RedisIndex.resync`); merge them in when the view is partial. True
        if written."""
        assert self.redis is not None
        seq, ts = self._position[pod]
        return self.redis.resync(pod, seq, ts, self.local.snapshot(pod),
                                 self._block_size.get(pod), merge=pod in self._partial)

    def forget_pod(self, pod: str, gone: bool = True) -> None:
        """Drop the pod's index entries everywhere: it is gone (its registration,
        pool membership and load entry go too) or, with `gone=False`, it changed its
        event endpoint (they stay).

        While Redis is down the purge waits for its return, and is then index-only:
        the pod may have been registered again meanwhile."""
        self.local.clear(pod)
        self._position.pop(pod, None)
        self._partial.discard(pod)
        self._restarted_later.pop(pod, None)
        if self.redis is None:
            return
        if self._degraded:
            self._purge_later.add(pod)
            return
        try:
            purge_pods(self.redis.sync, [pod], index_only=not gone)
        except RedisError as err:
            self._purge_later.add(pod)
            self._degrade(err)

    def restarted(self, pod: str, last_ts: float, seen: tuple[int, float]) -> None:
        """The pod's engine restarted (its cache is empty), as batch `seen` (seq, ts)
        of its new incarnation shows; this replica's last batch of the old one had
        `last_ts`. Its entries go here and, unless Redis already holds the new
        incarnation's (another replica saw the restart first), in Redis
        (`RedisIndex.purge_restarted`); its registration stays.

        While Redis is down the purge waits for its return; a pod fed again by
        then is re-synced instead."""
        self.local.clear(pod)
        self._position.pop(pod, None)
        self._partial.discard(pod)
        if self.redis is None:
            return
        if not self._degraded:
            try:
                self.redis.purge_restarted(pod, last_ts, seen)
                return
            except RedisError as err:
                self._degrade(err)
        self._restarted_later[pod] = (last_ts, seen)

    def _purge_pending(self) -> None:
        assert self.redis is not None
        for pod in list(self._purge_later):
            if pod not in self._position:  # not fed again meanwhile (a re-sync covers that)
                purge_pods(self.redis.sync, [pod], index_only=True)
            self._purge_later.discard(pod)
        for pod, (last_ts, seen) in list(self._restarted_later.items()):
            if pod not in self._position:
                self.redis.purge_restarted(pod, last_ts, seen)
            del self._restarted_later[pod]

    def stored_position(self, pod: str) -> tuple[int, float] | None:
        """(seq, ts) last applied to Redis for `pod` (None: unknown / Redis down)."""
        if self.redis is None or self._degraded:
            return None
        try:
            return self.redis.stored_position(pod)
        except RedisError as err:
            self._degrade(err)
            return None

    def warm_from_redis(self, pod: str, seq: int, ts: float) -> bool:
        """Load the pod's entries, applied up to batch `seq` (of time `ts`), from Redis
        into the local view (gateway restart). False if they could not be read: the
        caller replays the engine from 0 instead (a view that missed them must not
        count as at `seq`, or a re-sync would write it over Redis's)."""
        if self.redis is None or self._degraded:
            return False
        try:
            hashes = self.redis.load_hashes(pod)
        except RedisError as err:
            self._degrade(err)
            return False
        self.local.store(pod, list(hashes.items()))
        self._position[pod] = (seq, ts)
        self._partial.discard(pod)
        return True

    def recover(self) -> bool:
        """If degraded and Redis answers again: re-sync every pod, back to redis mode."""
        if self.redis is None or not self._degraded:
            return False
        try:
            self.redis.sync.ping()
            self._epoch = self.redis.epoch()
            self._purge_pending()
            rewritten = sum(self._resync(pod) for pod in list(self._position))
        except RedisError:
            return False
        with self._lock:
            self._degraded = False
            self._slow = 0
        log.warning("redis is back: index re-synced for %d of %d pods (the others were "
                    "current there)", rewritten, len(self._position))
        for cb in self.on_mode_change:
            cb(self.mode)
        return True

    # -- request path ----------------------------------------------------------------------
    async def lookup(self, keys: list[str], pods: list[str]) -> Found:
        """Hits per pod, loads from Redis (None: the caller uses its local loads) and
        keys held per pod, from Redis or else the local view. Redis's hits are
        extended by this replica's own speculative entries, which reach Redis up
        to `flush_after_s` later (or were decided while this lookup was in
        flight): a burst of one prefix sticks to one pod from its second request."""
        if self.redis is not None and not self._degraded and not self.read_local:
            try:
                hits, loads, held = await self.redis.lookup(
                    keys, pods, now_ms(), time.monotonic() + self.lookup_timeout_s)
                self._slow = 0
                return Found(self.local.with_speculative(keys, hits, pods, now_ms()),
                             loads, held)
            except TimeoutError:
                self._timed_out()  # this request uses the local view
            except (RedisError, OSError) as err:
                self._degrade(err if isinstance(err, RedisError) else RedisError(repr(err)))
        return Found(self.local.lookup(keys, pods, now_ms()), None, self.local.held(pods))

    def speculate(self, pod: str, keys: list[str], ttl_ms: int) -> None:
        """Record a routing decision: `pod` will hold `keys` for `ttl_ms`: in the
        local view now, in Redis within `flush_after_s`, batched with the other
        decisions of that interval. Not with the request's own lookup, nor each
        alone: the lookup would wait for the write in Redis, and on a busy host
        every extra round trip wakes Redis and the gateway once more (~0.1-0.2 ms
        of p50 overhead at 200 requests/s, docs/benchmarks.md). Other replicas see
        the entry up to `flush_after_s` later, well before a prefill ends and
        the engine's own events arrive."""
        if not keys or ttl_ms <= 0:
            return
        t = now_ms()
        self.local.add_speculative(pod, keys, t + ttl_ms)
        if self._writer is not None and not self._degraded:
            self._writer.add(pod, keys, ttl_ms, t)

    def _timed_out(self) -> None:
        """A slow Redis answer: only a run of them counts as an outage (a busy Redis
        is not a dead one, and each switch to local mode costs a full re-sync)."""
        self._slow += 1
        if self._slow >= self.MAX_SLOW_LOOKUPS:
            self._degrade(RedisError(f"{self._slow} Redis calls in a row timed out"))
