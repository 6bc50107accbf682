"""The shared prefix index and load table in Redis (layout: `sluice.index_keys`).

Writes come from each gateway's event feeder thread (redis-py's sync client),
reads and speculative writes from request handlers (redis-py's asyncio client,
`async_client`; every call bounded by a deadline: `redis_script`). Every
multi-key operation is one Lua script, so it is atomic and costs one round trip:

- `apply(pod, seq, ops)`: applies one event batch unless `seq` is not newer
  than the pod's stored seq (`redis_apply`). With several gateway replicas each
  applying every engine's events, this makes application exactly-once and in
  order.
- `resync(...)`, `purge_restarted(...)`: rewrite a pod's entries, fenced
  against the other replicas' batches (`redis_rewrite`).
- `lookup(keys, pods)`: per pod the length of the run of leading keys it holds
  (confirmed or unexpired speculative), every pod's load entry, and how many
  keys each pod holds (confirmed: what its cache is filled with).
- `speculate_later(pod, keys, ttl)`: speculative entries with an expiry,
  queued; `flush()` sends all queued in one write.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from sluice import index_keys as ik
from sluice.gateway.index.redis_apply import APPLY, Outcome, P
from sluice.gateway.index.redis_rewrite import PodRewriter
from sluice.gateway.index.redis_script import Script, bounded, pipeline, raise_first, run_scripts

assert ik.pod_spec_key("X") == P + "pod:X:spec" and ik.load_key("X") == P + "load:X"
assert ik.SPEC_CHANNEL == P + "spec"

# Keys travel as one argument, concatenated (each is KEY_WIDTH chars): redis-py
# packs every argument separately in Python, which for the 512 keys of an
# 8k-token prompt cost more than the lookup itself in Redis.
KEY_WIDTH = 16
SPLIT_KEYS = """
local function split_keys(blob)
  local keys = {}
  for i = 1, #blob, KEY_WIDTH do keys[#keys + 1] = string.sub(blob, i, i + KEY_WIDTH - 1) end
  return keys
end
""".replace("KEY_WIDTH", str(KEY_WIDTH))

# ARGV: prefix, now_ms, npods, pods..., keys blob
#   -> {{pod, hits}..., {pod, w, r, kv, ts}..., {pod, held}...}
# Per pod: one SMISMEMBER over its key set and one ZMSCORE over its speculative
# entries, for all the prompt's keys at once (chunks of CHUNK); the run ends at
# the first key that is in neither.
LOOKUP = SPLIT_KEYS + """
local P, now, np = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keys = split_keys(ARGV[4 + np])
local last = #keys
local flat, loads, held = {}, {}, {}
for j = 1, np do
  local pod = ARGV[3 + j]
  local l = redis.call('HMGET', P..'load:'..pod, 'waiting', 'running', 'kv_usage', 'ts_ms')
  if l[1] then loads[#loads + 1] = {pod, l[1], l[2], l[3], l[4]} end
  held[#held + 1] = pod
  held[#held + 1] = redis.call('SCARD', P..'pod:'..pod..':keys')
  local run, c0 = 0, 1
  local spec = redis.call('EXISTS', P..'pod:'..pod..':spec') == 1
  while c0 <= last do
    local c1 = math.min(c0 + CHUNK - 1, last)
    local m = redis.call('SMISMEMBER', P..'pod:'..pod..':keys', unpack(keys, c0, c1))
    local s = nil
    if spec then s = redis.call('ZMSCORE', P..'pod:'..pod..':spec', unpack(keys, c0, c1)) end
    local broke = false
    for x = 1, #m do
      if m[x] == 1 or (s and s[x] and tonumber(s[x]) > now) then
        run = run + 1
      else
        broke = true
        break
      end
    end
    if broke then break end
    c0 = c1 + 1
  end
  if run > 0 then flat[#flat + 1] = pod; flat[#flat + 1] = run end
end
return {flat, loads, held}
""".replace("CHUNK", "1024")

# ARGV: prefix, pod, expiry_ms, ttl_ms, keys blob, replica id, 1 while this replica's
# mirror listens (else 0). An entry's expiry and the key's TTL only grow: a shorter
# decision (another replica's TTL) never cuts a longer one short, so the expiry is capped
# at Redis's clock + the TTL (a replica whose clock runs ahead cannot make an entry
# outlive it). Published on `index_keys.SPEC_CHANNEL` ("replica\npod\nexpiry_ms\nkeys
# blob", for `spec_mirror`) when someone besides this replica's mirror listens (a lone
# replica's mirror would wake only to skip its own message), or when PUBSUB is refused.
SPECULATE = SPLIT_KEYS + """
local P, pod, exp, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local keys = split_keys(ARGV[5])
local t = redis.call('TIME')
exp = math.min(exp, t[1] * 1000 + math.floor(t[2] / 1000) + ttl)
local k = P..'pod:'..pod..':spec'
for c0 = 1, #keys, 512 do
  local args = {}
  for x = c0, math.min(c0 + 511, #keys) do
    args[#args + 1] = exp
    args[#args + 1] = keys[x]
  end
  redis.call('ZADD', k, 'GT', unpack(args))
end
redis.call('ZREMRANGEBYSCORE', k, '-inf', '('..(exp - ttl))
if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
-- (pcall: a Redis user without channel rights still gets the entries written)
local listening = redis.pcall('PUBSUB', 'NUMSUB', P..'spec')
if listening.err ~= nil or listening[2] > tonumber(ARGV[7]) then
  local msg = ARGV[6]..'\\n'..pod..'\\n'..exp..'\\n'..ARGV[5]  -- (exp as ZADD has it)
  redis.pcall('PUBLISH', P..'spec', msg)
end
return #keys
"""


# Connections of one gateway's asyncio client. Each call holds one for its round
# trip (redis-py does not multiplex a connection), so this bounds the lookups in
# flight; more callers wait for a free one, within their own deadline.
POOL_SIZE = 16
HEALTH_CHECK_INTERVAL_S = 10


def async_client(url: str, timeout_s: float) -> redis.asyncio.Redis:
    """redis-py's asyncio client as request handlers use it (see `redis_script` for
    how each call is bounded):

    - no socket timeout of its own: every call has a deadline, which also covers
      a connection gone silent (redis-py closes one whose read was interrupted);
      connects are bounded by `timeout_s` too.
    - one immediate retry, on a new connection, of a call whose connection turns
      out dead (a ConnectionError: reset by a NAT, or by a Redis restart not yet
      seen), so that does not fail a request; a Redis that is down refuses the
      retry as fast. Not redis-py's default of 3 retries with back-off: against a
      hung Redis that stalls ~10 s, and the caller has its own fallback.
    - a connection idle for `HEALTH_CHECK_INTERVAL_S` is pinged before use.
    - no maintenance notifications (a Redis Enterprise feature): with them on,
      redis-py hands out a pooled connection Redis has closed without checking.
    """
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=POOL_SIZE, timeout=None,
        retry=AsyncRetry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        socket_timeout=None, socket_connect_timeout=timeout_s,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        maint_notifications_config=MaintNotificationsConfig(enabled=False))
    return redis.asyncio.Redis.from_pool(pool)  # (its aclose() closes the pool)


class RedisIndex:
    """Thin typed wrapper over the scripts; raises redis errors to the caller.

    `lease_ms`: how long this replica's fence on a pod it rewrites outlasts its
    last step (see `redis_rewrite`). `timeout_s`: the deadline of an asyncio call
    whose caller gives none."""

    def __init__(self, sync_client: Any, async_client: redis.asyncio.Redis,
                 lease_ms: int = 10_000, timeout_s: float = 1.0) -> None:
        self.sync = sync_client
        self.aio = async_client
        self.timeout_s = timeout_s
        self._apply = sync_client.register_script(APPLY)
        self.replica_id = uuid.uuid4().hex  # (this gateway replica's, in fences and mirrors)
        self.own_mirror: threading.Event | None = None  # set while this replica's mirror listens
        self._rewriter = PodRewriter(sync_client, self._apply, self.replica_id, lease_ms)
        self._lookup = Script(async_client, LOOKUP)
        self._spec = Script(async_client, SPECULATE)
        self._pending: list[tuple[Script, list[Any]]] = []  # queued speculations

    @classmethod
    def from_url(cls, url: str, timeout_s: float, lease_ms: int = 10_000) -> RedisIndex:
        """Clients that fail after `timeout_s`: the sync one without redis-py's
        retries (3 with back-off stall ~10 s against a hung Redis, and the caller
        has its own fallback), the asyncio one as `async_client` says."""
        opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                "health_check_interval": HEALTH_CHECK_INTERVAL_S}
        return cls(redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **opts),
                   async_client(url, timeout_s), lease_ms, timeout_s)

    def _deadline(self, deadline: float | None) -> float:
        return time.monotonic() + self.timeout_s if deadline is None else deadline

    def apply(self, pod: str, seq: int, ops: bytes, ts: float = 0.0, epoch: str = "") -> Outcome:
        """Apply feed batch `seq` (>= 0) of `pod`, unless stale, fenced or Redis's
        epoch is not `epoch` (LOST; '': not checked)."""
        assert seq >= 0, seq
        return Outcome(self._apply(args=[P, pod, seq, ops, repr(float(ts)), "", 0, epoch]))

    def epoch(self) -> str:
        """Redis's epoch (`index_keys.EPOCH_KEY`), set to a new random id if absent."""
        pipe = self.sync.pipeline(transaction=False)
        pipe.set(ik.EPOCH_KEY, uuid.uuid4().hex, nx=True)
        pipe.get(ik.EPOCH_KEY)
        value = pipe.execute()[1]
        if value is None:
            raise RedisError("redis dropped the epoch key it was just given")
        return _s(value)

    def stored_position(self, pod: str) -> tuple[int, float] | None:
        """(seq, ts) of the pod's last applied batch; ts 0.0 when unknown. None also
        while another replica rewrites the pod (fenced): its entries are half
        rewritten, so a gateway starting then replays the engine instead of
        warming from them."""
        pipe = self.sync.pipeline(transaction=False)
        pipe.mget(ik.pod_seq_key(pod), ik.pod_ts_key(pod))
        pipe.exists(ik.pod_sync_key(pod))
        (seq, ts), fenced = pipe.execute()
        return None if seq is None or fenced else (int(seq), float(ts or 0.0))

    def load_hashes(self, pod: str) -> dict[str, str]:
        """The pod's engine-hash -> key map (to warm a restarted gateway)."""
        return {_s(f): _s(k) for f, k in self.sync.hgetall(ik.pod_hashes_key(pod)).items()}

    def resync(self, pod: str, seq: int, ts: float, hashes: dict[str, str],
               block_size: int | None, merge: bool = False) -> bool:
        """Replace the pod's entries with `hashes` (the local view; with `merge`, add
        them) at batch `seq` (`ts`), unless Redis's position covers it or another
        replica is rewriting the pod. True if written."""
        return self._rewriter.resync(pod, seq, ts, hashes, block_size, merge)

    def purge_restarted(self, pod: str, last_ts: float, seen: tuple[int, float]) -> bool:
        """Drop the entries of a restarted engine unless Redis already holds its new
        incarnation's (`PodRewriter.purge_restarted`). True if purged."""
        return self._rewriter.purge_restarted(pod, last_ts, seen)

    def register_pod(self, pod: str, namespace: str, pool: str, model: str) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.hset(ik.pod_meta_key(pod), mapping={"namespace": namespace, "pool": pool,
                                                  "model": model})
        pipe.sadd(ik.pool_pods_key(namespace, pool), pod)
        pipe.execute()

    async def lookup(self, keys: list[str], pods: list[str], now_ms: float,
                     deadline: float | None = None
                     ) -> tuple[dict[str, int], dict[str, dict[str, float]], dict[str, int]]:
        """Per pod its run of leading keys held, every pod's load entry, and per
        pod the number of keys it holds; TimeoutError past `deadline`
        (`time.monotonic()`)."""
        hits_flat, loads, held_flat = await self._lookup(
            [P, now_ms, len(pods), *pods, _blob(keys)], self._deadline(deadline))
        hits, held = _pairs(hits_flat), _pairs(held_flat)
        table = {_s(row[0]): {"waiting": float(row[1]), "running": float(row[2]),
                              "kv_usage": float(row[3]), "ts_ms": float(row[4])}
                 for row in loads}
        return hits, table, held

    def speculate_later(self, pod: str, keys: list[str], ttl_ms: int, now_ms: float) -> None:
        """Queue speculative entries (sent by the next `flush`)."""
        if keys:
            own = self.own_mirror is not None and self.own_mirror.is_set()
            self._pending.append((self._spec, [P, pod, now_ms + ttl_ms, ttl_ms, _blob(keys),
                                                self.replica_id, int(own)]))

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self, deadline: float | None = None) -> None:
        """Send the queued speculations now."""
        calls = self._take_pending()
        if calls:
            await run_scripts(self.aio, calls, self._deadline(deadline))

    def _take_pending(self) -> list[tuple[Script, list[Any]]]:
        calls, self._pending = self._pending, []
        return calls

    async def write_loads(self, loads: dict[str, dict[str, float]], ttl_ms: int,
                          read: list[str] = (), deadline: float | None = None
                          ) -> dict[str, dict[str, float]]:
        """Write load entries (TTL `ttl_ms`); in the same round trip read the
        unexpired entries of the pods `read` (after the writes)."""
        cmds: list[tuple] = []
        for pod, fields in loads.items():
            cmds.append(("HSET", ik.load_key(pod), *(x for kv in fields.items() for x in kv)))
            cmds.append(("PEXPIRE", ik.load_key(pod), ttl_ms))
        cmds.extend(("HMGET", ik.load_key(pod), *ik.LOAD_FIELDS) for pod in read)
        if not cmds:
            return {}
        replies = await bounded(pipeline(self.aio, cmds), self._deadline(deadline))
        raise_first(replies)
        out = {}
        for pod, row in zip(read, replies[len(cmds) - len(read):]):
            try:
                out[pod] = dict(zip(ik.LOAD_FIELDS, map(float, row)))
            except (TypeError, ValueError):  # absent, or not written by a gateway
                pass
        return out


def _blob(keys: list[str]) -> str:
    """The keys as one script argument (see SPLIT_KEYS)."""
    blob = "".join(keys)
    assert len(blob) == KEY_WIDTH * len(keys), "request keys are KEY_WIDTH hex chars"
    return blob


def _pairs(flat: list[Any]) -> dict[str, int]:
    return {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
