"""Rewriting one pod's entries in the Redis index while other gateway replicas feed it.

Two rewrites: a re-sync (a replica back from a Redis outage replaces the pod's
entries with its local view at its last applied batch) and a restart purge (the
engine restarted: its old entries go). A pod can hold millions of keys, so a
rewrite is many script calls, not one: Redis keeps answering lookups meanwhile.

Protocol (each step one Lua script, so each is atomic):

1. CLAIM: the replica takes the pod's fence (`pod:X:sync`: its owner id and a
   lease) only if the rewrite is due, judged atomically on the pod's stored
   (seq, ts): a re-sync is skipped when Redis's position covers the replica's (a
   replica that never lost Redis applied as far or further, or a newer engine
   incarnation's batches); a restart purge is skipped when Redis already holds the
   new incarnation (another replica saw the restart first and rebuilt from it).
   It is skipped too while another replica's lease lasts (that one rewrites).
   A lapsed fence (its owner died half-way) is taken over whatever the position:
   the entries are half rewritten.
2. PURGE steps pop the pod's keys 1000 at a time, then drop its hashes (not its
   speculative entries: the replicas' routing decisions stand).
3. Chunks of the view are written by APPLY under the fence.
4. RELEASE sets the pod's (seq, ts) to the replica's position (a restart purge:
   none, so the new incarnation's batches from 0 apply) and drops the fence.

Every step renews the lease and checks that the fence is still the replica's
(a purge of the pod or a takeover ends the rewrite: `False`). Meanwhile APPLY
refuses the pod's feed batches from every replica: the rewriter applies them
itself afterwards, feeding on from the position it wrote (it receives every
batch; after a restart purge it replays the engine from 0). So no batch applied
by another replica is lost to a purge, and none is refused as stale before it
is in Redis. Leases are kept on Redis's clock (`TIME`), so the replicas' clocks
need not agree.
"""

from __future__ import annotations

from typing import Any

from sluice.gateway.index.redis_apply import SERVER_NOW_MS, Outcome, P, encode_ops

CHUNK = 5000  # view entries per APPLY call

# ARGV: prefix, pod, owner, lease_ms, mode, mode args -> 1: claimed, 0: skip.
# mode "resync" (seq, ts: the replica's position): due unless Redis's (ts, seq) is
# not older. mode "restart" (last_ts: the replica's last batch of the old engine;
# seq, ts: the batch of the new one that showed the restart, seq <= the replica's
# last seq): due unless Redis holds the new engine's batches: newer than last_ts,
# and before (lower seq) or at / past (ts not older) that batch. Redis holding the
# old engine's batches past the replica's has a seq above the replica's, hence at
# least that batch's seq, with an older ts. A pod with no seq and no fence has no
# entries (purged, or never fed): a restart purge of it is skipped.
CLAIM = SERVER_NOW_MS + """
local P, pod, owner, now = ARGV[1], ARGV[2], ARGV[3], server_now_ms()
local base = P..'pod:'..pod..':'
local fence = redis.call('HMGET', base..'sync', 'owner', 'until')
if fence[1] and fence[1] ~= owner and tonumber(fence[2]) > now then return 0 end
local rseq = tonumber(redis.call('GET', base..'seq') or '-1')
local rts = tonumber(redis.call('GET', base..'ts') or '0')
if not fence[1] then
  if ARGV[5] == 'resync' then
    local seq, ts = tonumber(ARGV[6]), tonumber(ARGV[7])
    if rseq >= 0 and (rts > ts or (rts == ts and rseq >= seq)) then return 0 end
  else
    local last_ts, seq, ts = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
    if rseq < 0 or (rts > last_ts and (rseq < seq or rts >= ts)) then return 0 end
  end
end
redis.call('HSET', base..'sync', 'owner', owner, 'until', now + tonumber(ARGV[4]))
return 1
"""

# ARGV: prefix, pod, owner, lease_ms -> 1: more to purge, 0: purged, -1: not (or no
# longer) the fence's owner.
PURGE_STEP = SERVER_NOW_MS + """
local P, pod = ARGV[1], ARGV[2]
local base = P..'pod:'..pod..':'
if redis.call('HGET', base..'sync', 'owner') ~= ARGV[3] then return -1 end
redis.call('HSET', base..'sync', 'until', server_now_ms() + tonumber(ARGV[4]))
local popped = redis.call('SPOP', base..'keys', 1000)
for _, k in ipairs(popped) do redis.call('SREM', P..'blk:'..k, pod) end
if #popped > 0 then return 1 end
redis.call('DEL', base..'ehash', base..'kdup')  -- (speculative entries stay: routing
return 0                                           -- decisions, of every replica)
"""

# ARGV: prefix, pod, owner, seq (-1: none), ts -> 1: done, 0: not the fence's owner.
RELEASE = """
local base = ARGV[1]..'pod:'..ARGV[2]..':'
if redis.call('HGET', base..'sync', 'owner') ~= ARGV[3] then return 0 end
if tonumber(ARGV[4]) >= 0 then
  redis.call('SET', base..'seq', ARGV[4])
  redis.call('SET', base..'ts', ARGV[5])
else
  redis.call('DEL', base..'seq', base..'ts')
end
redis.call('DEL', base..'sync')
return 1
"""


class PodRewriter:
    """One replica's rewrites (its own `owner` id); `apply` is its APPLY script."""

    def __init__(self, sync_client: Any, apply: Any, owner: str, lease_ms: int) -> None:
        assert lease_ms > 0 and owner
        self.owner = owner
        self.lease_ms = lease_ms
        self._apply = apply
        self._claim = sync_client.register_script(CLAIM)
        self._purge_step = sync_client.register_script(PURGE_STEP)
        self._release = sync_client.register_script(RELEASE)

    def resync(self, pod: str, seq: int, ts: float, hashes: dict[str, str],
               block_size: int | None, merge: bool = False) -> bool:
        """Replace the pod's entries with `hashes` at position (`seq`, `ts`), unless
        Redis's position covers it; with `merge`, add them to the pod's entries
        (no PURGE: `hashes` may lack some that Redis holds). True if written."""
        assert seq >= 0
        return self._rewrite(pod, ["resync", seq, repr(float(ts))], hashes, block_size,
                             seq, ts, purge=not merge)

    def purge_restarted(self, pod: str, last_ts: float, seen: tuple[int, float]) -> bool:
        """The engine restarted, shown by batch `seen` (seq, ts) of its new
        incarnation; this replica's last batch of the old one had `last_ts`. Drop
        the pod's entries unless Redis already holds the new incarnation's. True if
        purged."""
        return self._rewrite(pod, ["restart", repr(float(last_ts)), seen[0],
                                   repr(float(seen[1]))], {}, None, -1, 0.0)

    def _rewrite(self, pod: str, guard: list[Any], hashes: dict[str, str],
                 block_size: int | None, seq: int, ts: float, purge: bool = True) -> bool:
        """The protocol above: False when CLAIM skips it or the fence was lost."""
        if not self._claim(args=[P, pod, self.owner, self.lease_ms, *guard]):
            return False
        while purge and (step := self._purge_step(
                args=[P, pod, self.owner, self.lease_ms])) != 0:
            if step < 0:
                return False
        items = list(hashes.items())
        for start in range(0, max(len(items), 1), CHUNK):
            ops = encode_ops(items[start:start + CHUNK], [], False,
                             block_size if start == 0 else None)
            if self._apply(args=[P, pod, -1, ops, 0, self.owner,
                                 self.lease_ms]) != Outcome.APPLIED:
                return False
        return bool(self._release(args=[P, pod, self.owner, seq, repr(float(ts))]))

