"""The shared prefix index and load table in Redis (layout: `sluice.index_keys`).

Writes come from each gateway's event feeder thread (sync client), reads from
request handlers (asyncio client). Every multi-key operation is one Lua script,
so it is atomic and costs one round trip:

- `apply(pod, seq, ops)`: applies one event batch unless `seq` is not newer
  than the pod's stored seq. With several gateway replicas each applying every
  engine's events, this makes application exactly-once and in order.
- `lookup(keys, pods)`: per pod the length of the run of leading keys it holds
  (confirmed or unexpired speculative), plus every pod's load entry.
- `speculate(pod, keys, ttl)`: speculative holders with an expiry.
"""

from __future__ import annotations

from typing import Any

from sluice import index_keys as ik

P = ik.PREFIX
assert ik.block_key("K") == P + "blk:K" and ik.spec_key("K") == P + "spec:K"
assert ik.pod_keys_key("X") == P + "pod:X:keys" and ik.pod_hashes_key("X") == P + "pod:X:ehash"
assert ik.pod_seq_key("X") == P + "pod:X:seq" and ik.load_key("X") == P + "load:X"

# ARGV: prefix, pod, seq, then ops: "S" n (field key)*n | "R" n field*n | "C" | "B" size
APPLY = """
local P, pod, seq = ARGV[1], ARGV[2], tonumber(ARGV[3])
local seqk = P..'pod:'..pod..':seq'
local last = tonumber(redis.call('GET', seqk) or '-1')
if seq >= 0 and seq <= last then return 0 end
local keys, hashes = P..'pod:'..pod..':keys', P..'pod:'..pod..':ehash'
local i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    local n = tonumber(ARGV[i+1]); i = i + 2
    for j = 0, n - 1 do
      local f, k = ARGV[i + 2*j], ARGV[i + 2*j + 1]
      redis.call('HSET', hashes, f, k)
      redis.call('SADD', P..'blk:'..k, pod)
      redis.call('SADD', keys, k)
    end
    i = i + 2*n
  elseif op == 'R' then
    local n = tonumber(ARGV[i+1]); i = i + 2
    for j = 0, n - 1 do
      local f = ARGV[i + j]
      local k = redis.call('HGET', hashes, f)
      if k then
        redis.call('HDEL', hashes, f)
        redis.call('SREM', P..'blk:'..k, pod)
        redis.call('SREM', keys, k)
      end
    end
    i = i + n
  elseif op == 'C' then
    for _, k in ipairs(redis.call('SMEMBERS', keys)) do
      redis.call('SREM', P..'blk:'..k, pod)
    end
    redis.call('DEL', keys, hashes)
    i = i + 1
  elseif op == 'B' then
    redis.call('HSET', P..'pod:'..pod..':meta', 'block_size', ARGV[i+1])
    i = i + 2
  else
    return redis.error_reply('bad op '..tostring(op))
  end
end
if seq >= 0 then redis.call('SET', seqk, seq) end
return 1
"""

# ARGV: prefix, now_ms, npods, pods..., keys...  -> {{pod, hits}..., {pod, w, r, kv, ts}...}
LOOKUP = """
local P, now, np = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local alive, hits, loads = {}, {}, {}
for j = 1, np do
  local pod = ARGV[3 + j]
  alive[pod] = true
  local l = redis.call('HMGET', P..'load:'..pod, 'waiting', 'running', 'kv_usage', 'ts_ms')
  if l[1] then table.insert(loads, {pod, l[1], l[2], l[3], l[4]}) end
end
for i = 4 + np, #ARGV do
  local k = ARGV[i]
  local cur = {}
  for _, p in ipairs(redis.call('SMEMBERS', P..'blk:'..k)) do cur[p] = true end
  for _, p in ipairs(redis.call('ZRANGEBYSCORE', P..'spec:'..k, '('..now, '+inf')) do
    cur[p] = true
  end
  local any = false
  for p, _ in pairs(alive) do
    if cur[p] then hits[p] = i - 3 - np; any = true else alive[p] = nil end
  end
  if not any then break end
end
local flat = {}
for p, n in pairs(hits) do table.insert(flat, p); table.insert(flat, n) end
return {flat, loads}
"""

# ARGV: prefix, pod, expiry_ms, ttl_ms, keys...
SPECULATE = """
local P, pod, exp, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 5, #ARGV do
  local k = P..'spec:'..ARGV[i]
  redis.call('ZADD', k, 'GT', exp, pod)
  redis.call('PEXPIRE', k, ttl)
end
return #ARGV - 4
"""


def encode_ops(stored: list[tuple[str, str]], removed: list[str], cleared: bool,
               block_size: int | None = None) -> list[Any]:
    """Flatten one batch's effects for APPLY (clear first: vLLM emits it alone)."""
    ops: list[Any] = []
    if cleared:
        ops.append("C")
    if block_size is not None:
        ops += ["B", block_size]
    if stored:
        ops += ["S", len(stored)]
        for field, key in stored:
            ops += [field, key]
    if removed:
        ops += ["R", len(removed), *removed]
    return ops


class RedisIndex:
    """Thin typed wrapper over the scripts; raises redis errors to the caller."""

    def __init__(self, sync_client: Any, async_client: Any) -> None:
        self.sync = sync_client
        self.aio = async_client
        self._apply = sync_client.register_script(APPLY)
        self._spec_sync = sync_client.register_script(SPECULATE)
        self._lookup = async_client.register_script(LOOKUP)
        self._spec = async_client.register_script(SPECULATE)

    def apply(self, pod: str, seq: int, ops: list[Any]) -> bool:
        """Apply one batch (seq < 0: unconditionally, seq untouched). False if stale."""
        return bool(self._apply(args=[P, pod, seq, *ops]))

    def stored_seq(self, pod: str) -> int | None:
        raw = self.sync.get(ik.pod_seq_key(pod))
        return None if raw is None else int(raw)

    def load_hashes(self, pod: str) -> dict[str, str]:
        """The pod's engine-hash -> key map (to warm a restarted gateway)."""
        return {_s(f): _s(k) for f, k in self.sync.hgetall(ik.pod_hashes_key(pod)).items()}

    def resync(self, pod: str, seq: int, hashes: dict[str, str],
               block_size: int | None) -> None:
        """Replace the pod's entries with `hashes` (the local view) at `seq`."""
        ik.purge_pods(self.sync, [pod])
        items = list(hashes.items())
        chunk = 5000
        for start in range(0, max(len(items), 1), chunk):
            part = items[start:start + chunk]
            last = start + chunk >= len(items)
            self.apply(pod, seq if last else -1,
                       encode_ops(part, [], False, block_size if start == 0 else None))

    def register_pod(self, pod: str, namespace: str, pool: str, model: str) -> None:
        pipe = self.sync.pipeline(transaction=False)
        pipe.hset(ik.pod_meta_key(pod), mapping={"namespace": namespace, "pool": pool,
                                                  "model": model})
        pipe.sadd(ik.pool_pods_key(namespace, pool), pod)
        pipe.execute()

    async def lookup(self, keys: list[str], pods: list[str], now_ms: float
                     ) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
        hits_flat, loads = await self._lookup(args=[P, now_ms, len(pods), *pods, *keys])
        hits = {_s(hits_flat[i]): int(hits_flat[i + 1]) for i in range(0, len(hits_flat), 2)}
        table = {_s(row[0]): {"waiting": float(row[1]), "running": float(row[2]),
                              "kv_usage": float(row[3]), "ts_ms": float(row[4])}
                 for row in loads}
        return hits, table

    async def speculate(self, pod: str, keys: list[str], ttl_ms: int, now_ms: float) -> None:
        if keys:
            await self._spec(args=[P, pod, now_ms + ttl_ms, ttl_ms, *keys])

    async def write_loads(self, loads: dict[str, dict[str, float]], ttl_ms: int) -> None:
        pipe = self.aio.pipeline(transaction=False)
        for pod, fields in loads.items():
            pipe.hset(ik.load_key(pod), mapping=fields)
            pipe.pexpire(ik.load_key(pod), ttl_ms)
        await pipe.execute()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
