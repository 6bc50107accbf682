"""The shared prefix index and load table in Redis (layout: `sluice.index_keys`).

Writes come from each gateway's event feeder thread (redis-py's sync client),
reads and speculative writes from request handlers (`RespClient`, a lean
asyncio client: redis-py's costs ~120 us of Python per call). Every multi-key
operation is one Lua script, so it is atomic and costs one round trip:

- `apply(pod, seq, ops)`: applies one event batch unless `seq` is not newer
  than the pod's stored seq. With several gateway replicas each applying every
  engine's events, this makes application exactly-once and in order.
- `lookup(keys, pods)`: per pod the length of the run of leading keys it holds
  (confirmed or unexpired speculative), plus every pod's load entry.
- `speculate(pod, keys, ttl)`: speculative entries with an expiry.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluice import index_keys as ik
from sluice.gateway.resp_client import RespClient, Script

_pack = msgspec.msgpack.Encoder().encode

P = ik.PREFIX
assert ik.block_key("K") == P + "blk:K" and ik.pod_spec_key("X") == P + "pod:X:spec"
assert ik.pod_keys_key("X") == P + "pod:X:keys" and ik.pod_hashes_key("X") == P + "pod:X:ehash"
assert ik.pod_seq_key("X") == P + "pod:X:seq" and ik.load_key("X") == P + "load:X"
assert ik.pod_ts_key("X") == P + "pod:X:ts"

# ARGV: prefix, pod, seq, ops = msgpack [cleared 0|1, block_size|0, stored fields,
# stored keys, removed fields], batch ts; applied in that order (clear, store, remove).
# Counts: a key is in `keys` (and the pod in its `blk`) while at least one engine hash
# maps to it; `kdup` counts the others (see index_keys). A field stored again with
# the same key changes nothing; with another key it moves from the old key to it.
APPLY = """
local P, pod, seq = ARGV[1], ARGV[2], tonumber(ARGV[3])
local seqk = P..'pod:'..pod..':seq'
local last = tonumber(redis.call('GET', seqk) or '-1')
if seq >= 0 and seq <= last then return 0 end
local base = P..'pod:'..pod..':'
local keys, hashes, dups = base..'keys', base..'ehash', base..'kdup'
local function hold(k)  -- one more engine hash maps to k
  if redis.call('SADD', keys, k) == 1 then
    redis.call('SADD', P..'blk:'..k, pod)
  else
    redis.call('HINCRBY', dups, k, 1)
  end
end
local function release(k)  -- one engine hash less maps to k
  local d = tonumber(redis.call('HGET', dups, k) or '0')
  if d > 1 then
    redis.call('HINCRBY', dups, k, -1)
  elseif d == 1 then
    redis.call('HDEL', dups, k)
  else
    redis.call('SREM', keys, k)
    redis.call('SREM', P..'blk:'..k, pod)
  end
end
local ops = cmsgpack.unpack(ARGV[4])
local cleared, bs, sf, sk, rf = ops[1], ops[2], ops[3], ops[4], ops[5]
if cleared == 1 then
  for _, k in ipairs(redis.call('SMEMBERS', keys)) do
    redis.call('SREM', P..'blk:'..k, pod)
  end
  redis.call('DEL', keys, hashes, dups)
end
if bs > 0 then redis.call('HSET', base..'meta', 'block_size', bs) end
local written = {}  -- field -> key stored by this batch (newer than `before`)
for c0 = 1, #sf, 1000 do
  local c1 = math.min(c0 + 999, #sf)
  local before = redis.call('HMGET', hashes, unpack(sf, c0, c1))
  local pairs_ = {}
  for j = c0, c1 do
    local f, k = sf[j], sk[j]
    local old = written[f]
    if old == nil then old = before[j - c0 + 1] end
    if old ~= k then
      if old then release(old) end
      hold(k)
      written[f] = k
      pairs_[#pairs_ + 1] = f
      pairs_[#pairs_ + 1] = k
    end
  end
  if #pairs_ > 0 then redis.call('HSET', hashes, unpack(pairs_)) end
end
for _, f in ipairs(rf) do
  local k = redis.call('HGET', hashes, f)
  if k then
    redis.call('HDEL', hashes, f)
    release(k)
  end
end
if seq >= 0 then
  redis.call('SET', seqk, seq)
  redis.call('SET', P..'pod:'..pod..':ts', ARGV[5])
end
return 1
"""

# KEYS: the pod's seq and ts keys; ARGV: seq, ts. Raises the stored seq (and its ts)
# to `seq`, never lowers it.
RAISE_SEQ = """
local last = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > last then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

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

# ARGV: prefix, now_ms, npods, pods..., keys blob -> {{pod, hits}..., {pod, w, r, kv, ts}...}
# Per pod: one SMISMEMBER over its key set and one ZMSCORE over its speculative
# entries, for all the prompt's keys at once (chunks of CHUNK); the run ends at
# the first key that is in neither.
LOOKUP = SPLIT_KEYS + """
local P, now, np = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keys = split_keys(ARGV[4 + np])
local last = #keys
local flat, loads = {}, {}
for j = 1, np do
  local pod = ARGV[3 + j]
  local l = redis.call('HMGET', P..'load:'..pod, 'waiting', 'running', 'kv_usage', 'ts_ms')
  if l[1] then loads[#loads + 1] = {pod, l[1], l[2], l[3], l[4]} end
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
return {flat, loads}
""".replace("CHUNK", "1024")

# ARGV: prefix, pod, expiry_ms, ttl_ms, keys blob
SPECULATE = SPLIT_KEYS + """
local P, pod, exp, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local keys = split_keys(ARGV[5])
local k = P..'pod:'..pod..':spec'
for c0 = 1, #keys, 512 do
  local args = {}
  for x = c0, math.min(c0 + 511, #keys) do
    args[#args + 1] = exp
    args[#args + 1] = keys[x]
  end
  redis.call('ZADD', k, unpack(args))
end
redis.call('ZREMRANGEBYSCORE', k, '-inf', '('..(exp - ttl))
redis.call('PEXPIRE', k, ttl)
return #keys
"""


def encode_ops(stored: list[tuple[str, str]], removed: list[str], cleared: bool,
               block_size: int | None = None) -> bytes:
    """One batch's effects as the single msgpack argument of APPLY."""
    return _pack([1 if cleared else 0, block_size or 0, [f for f, _ in stored],
                  [k for _, k in stored], removed])


class RedisIndex:
    """Thin typed wrapper over the scripts; raises redis errors to the caller."""

    def __init__(self, sync_client: Any, async_client: RespClient) -> None:
        self.sync = sync_client
        self.aio = async_client
        self._apply = sync_client.register_script(APPLY)
        self._raise_seq = sync_client.register_script(RAISE_SEQ)
        self._lookup = Script(async_client, LOOKUP)
        self._spec = Script(async_client, SPECULATE)

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> RedisIndex:
        """Clients that fail after `timeout_s`, without redis-py's retries: the caller
        has its own fallback (the local view), and a retried call against a hung
        Redis (3 retries with back-off) stalls ~10 s instead of `timeout_s`."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # health_check_interval: a connection idle that long is pinged before use,
        # so one dropped by a NAT or load balancer is replaced, not an outage
        opts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                "health_check_interval": 10}
        return cls(redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **opts),
                   RespClient(url, timeout_s=timeout_s, health_check_interval_s=10))

    def apply(self, pod: str, seq: int, ops: bytes, ts: float = 0.0) -> bool:
        """Apply one batch (seq < 0: unconditionally, seq untouched). False if stale."""
        return bool(self._apply(args=[P, pod, seq, ops, repr(float(ts))]))

    def stored_position(self, pod: str) -> tuple[int, float] | None:
        """(seq, ts) of the pod's last applied batch; ts 0.0 when unknown."""
        seq, ts = self.sync.mget(ik.pod_seq_key(pod), ik.pod_ts_key(pod))
        return None if seq is None else (int(seq), float(ts or 0.0))

    def load_hashes(self, pod: str) -> dict[str, str]:
        """The pod's engine-hash -> key map (to warm a restarted gateway)."""
        return {_s(f): _s(k) for f, k in self.sync.hgetall(ik.pod_hashes_key(pod)).items()}

    def resync(self, pod: str, seq: int, ts: float, hashes: dict[str, str],
               block_size: int | None) -> None:
        """Replace the pod's entries with `hashes` (the local view) at `seq` (`ts`).

        Chunks are applied unconditionally and the seq is only raised at the end:
        another replica applying the pod's next batch meanwhile (it sees no seq
        after the purge) must not make this replica's last chunk look stale."""
        ik.purge_pods(self.sync, [pod], index_only=True)
        items = list(hashes.items())
        chunk = 5000
        for start in range(0, max(len(items), 1), chunk):
            self.apply(pod, -1, encode_ops(items[start:start + chunk], [], False,
                                           block_size if start == 0 else None))
        self._raise_seq(keys=[ik.pod_seq_key(pod), ik.pod_ts_key(pod)],
                        args=[seq, repr(float(ts))])

    def register_pod(self, pod: str, namespace: str, pool: str, model: str) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.hset(ik.pod_meta_key(pod), mapping={"namespace": namespace, "pool": pool,
                                                  "model": model})
        pipe.sadd(ik.pool_pods_key(namespace, pool), pod)
        pipe.execute()

    async def lookup(self, keys: list[str], pods: list[str], now_ms: float
                     ) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
        hits_flat, loads = await self._lookup(args=[P, now_ms, len(pods), *pods, _blob(keys)])
        hits = {_s(hits_flat[i]): int(hits_flat[i + 1]) for i in range(0, len(hits_flat), 2)}
        table = {_s(row[0]): {"waiting": float(row[1]), "running": float(row[2]),
                              "kv_usage": float(row[3]), "ts_ms": float(row[4])}
                 for row in loads}
        return hits, table

    async def speculate(self, pod: str, keys: list[str], ttl_ms: int, now_ms: float) -> None:
        if keys:
            await self._spec(args=[P, pod, now_ms + ttl_ms, ttl_ms, _blob(keys)])

    async def write_loads(self, loads: dict[str, dict[str, float]], ttl_ms: int) -> None:
        cmds: list[tuple] = []
        for pod, fields in loads.items():
            cmds.append(("HSET", ik.load_key(pod), *(x for kv in fields.items() for x in kv)))
            cmds.append(("PEXPIRE", ik.load_key(pod), ttl_ms))
        await self.aio.pipeline(cmds)


def _blob(keys: list[str]) -> str:
    """The keys as one script argument (see SPLIT_KEYS)."""
    blob = "".join(keys)
    assert len(blob) == KEY_WIDTH * len(keys), "request keys are KEY_WIDTH hex chars"
    return blob


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
