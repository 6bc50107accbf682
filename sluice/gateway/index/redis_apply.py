"""Applying one event batch of one pod to the Redis index: the APPLY Lua script.

One script call per batch, so a batch is atomic and costs one round trip. A
feed batch is applied only if its seq is newer than the pod's stored one:
with several gateway replicas each applying every engine's events, each batch
is applied once and in order. A pod being rewritten (`redis_rewrite`) is
fenced: feed batches are refused while its rewriter's lease lasts (it applies
them itself when it feeds on from its rewrite), and answered `RESYNC` once the
lease has lapsed (the rewriter died half-way: the caller rewrites the pod). A
feed batch carries the Redis epoch its replica knows (`index_keys.EPOCH_KEY`):
another one there means Redis lost the data the replica fed it (`LOST`), and
the batch is not applied on top of the loss.
"""

from __future__ import annotations

import enum

import msgspec

from sluice import index_keys as ik

_pack = msgspec.msgpack.Encoder().encode

P = ik.PREFIX
assert ik.block_key("K") == P + "blk:K" and ik.pod_keys_key("X") == P + "pod:X:keys"
assert ik.pod_hashes_key("X") == P + "pod:X:ehash" and ik.pod_key_dups_key("X") == P + "pod:X:kdup"
assert ik.pod_seq_key("X") == P + "pod:X:seq" and ik.pod_ts_key("X") == P + "pod:X:ts"
assert ik.pod_meta_key("X") == P + "pod:X:meta" and ik.pod_sync_key("X") == P + "pod:X:sync"
assert ik.EPOCH_KEY == P + "epoch"


class Outcome(enum.IntEnum):
    REFUSED = 0   # already applied (stale seq), fenced by a rewrite, or a lost fence
    APPLIED = 1
    RESYNC = 2    # the pod's rewrite was abandoned half-way: rewrite it
    LOST = 3      # Redis's epoch is not the replica's: it lost its data


# Fence leases are on Redis's clock, so replicas' clocks need not agree. TIME is
# non-deterministic: with script effects replication (the default since Redis 5)
# a script may still write after it.
SERVER_NOW_MS = """
redis.replicate_commands()
local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# ARGV: prefix, pod, seq, ops = msgpack [cleared 0|1, block_size|0, stored fields,
# stored keys, removed fields], batch ts, owner, lease_ms[, epoch]. Effects are applied
# in that order (clear, store, remove). owner '': a feed batch (seq >= 0, sets the
# pod's seq and ts); else a rewrite chunk, applied only under that owner's fence
# (whose lease it renews), seq and ts untouched. epoch (feed batches; absent or '':
# not checked): the replica's Redis epoch.
# Counts: a key is in `keys` (and the pod in its `blk`) while at least one engine hash
# maps to it; `kdup` counts the others (see index_keys). A field stored again with
# the same key changes nothing; with another key it moves from the old key to it.
APPLY = SERVER_NOW_MS + """
local P, pod, seq, owner = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[6]
local base = P..'pod:'..pod..':'
local fence = redis.call('HMGET', base..'sync', 'owner', 'until')
if owner ~= '' then
  if fence[1] ~= owner then return 0 end
  redis.call('HSET', base..'sync', 'until', server_now_ms() + tonumber(ARGV[7]))
elseif (ARGV[8] or '') ~= '' and redis.call('GET', P..'epoch') ~= ARGV[8] then
  return 3
elseif fence[1] then
  if tonumber(fence[2]) > server_now_ms() then return 0 end
  return 2
elseif seq <= tonumber(redis.call('GET', base..'seq') or '-1') then
  return 0
end
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
if owner == '' then
  redis.call('SET', base..'seq', seq)
  redis.call('SET', base..'ts', ARGV[5])
end
return 1
"""


def encode_ops(stored: list[tuple[str, str]], removed: list[str], cleared: bool,
               block_size: int | None = None) -> bytes:
    """One batch's effects as the single msgpack argument of APPLY."""
    return _pack([1 if cleared else 0, block_size or 0, [f for f, _ in stored],
                  [k for _, k in stored], removed])
