"""Redis key layout of Sluice's shared prefix index and pod load table.

Leaf module (imports only `redis` lazily through the client it is given): the
gateway writes these keys, the operator reads them and purges pods it deletes.
All keys live under `sluice:`. A pod id is the engine's base URL `host:port`.

Layout (`K` = a gateway request key: 16 hex chars of a chained 64-bit hash over
token blocks, seeded by model name and block size, so it never depends on an
engine's hash seed):

- `sluice:blk:{K}`          SET   pods whose engine reported the block (events).
- `sluice:pod:{pod}:keys`   SET   every K the pod holds (so `AllBlocksCleared`
                                  or a vanished pod can clear its entries; routing
                                  lookups test a prompt's keys here, SMISMEMBER).
- `sluice:pod:{pod}:spec`   ZSET  K -> expiry (ms since epoch): speculative
                                  entries written by routing decisions; the key
                                  expires with its newest entry.
- `sluice:pod:{pod}:ehash`  HASH  engine block hash (`int` as decimal, `bytes`
                                  as hex) -> K ("dual keys"). Several engine
                                  hashes can map to one K: blocks with the same
                                  tokens and parent under another LoRA, multimodal
                                  input or cache salt.
- `sluice:pod:{pod}:kdup`   HASH  K -> n >= 1: n more of the pod's engine hashes
                                  map to K than one (absent: at most one). K
                                  leaves `keys` only with the last of them.
- `sluice:pod:{pod}:seq`    STR   last applied event-batch sequence number.
- `sluice:pod:{pod}:ts`     STR   that batch's timestamp.
- `sluice:pod:{pod}:sync`   HASH  `owner`, `until` (ms since epoch): a gateway is
                                  rewriting the pod's entries (re-sync, restart
                                  purge); its fence on the pod's feed batches.
- `sluice:pod:{pod}:meta`   HASH  `block_size`, `model`, `pool`, `namespace`,
                                  `topic` of the pod's engine.
- `sluice:load:{pod}`       HASH  `waiting`, `running` (ints), `kv_usage` (0-1),
                                  `ts_ms`; short TTL: an expired entry = unknown.
- `sluice:pool:{namespace}/{pool}:pods`  SET  pod ids gateways route to.
- `sluice:spec`             pub/sub channel: each speculative write is also
                                  published (`replica pod expiry keys`, one line
                                  each), so replicas that route on their own view
                                  mirror the other replicas' decisions.
- `sluice:epoch`            STR   a random id, set by the first gateway to find it
                                  absent (SET NX). Another value than a gateway
                                  knows means Redis lost its data (restarted
                                  empty): the gateway re-syncs every pod.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PREFIX = "sluice:"
LOAD_FIELDS = ("waiting", "running", "kv_usage", "ts_ms")
_SCAN_BATCH = 1000


EPOCH_KEY = PREFIX + "epoch"
SPEC_CHANNEL = PREFIX + "spec"


def block_key(key: str) -> str:
    """SET of pods that hold request key `key` (confirmed by engine events)."""
    return f"{PREFIX}blk:{key}"


def pod_spec_key(pod: str) -> str:
    """ZSET request key -> expiry ms: speculative entries of `pod`."""
    return f"{PREFIX}pod:{pod}:spec"


def pod_keys_key(pod: str) -> str:
    """SET of request keys held by `pod`."""
    return f"{PREFIX}pod:{pod}:keys"


def pod_hashes_key(pod: str) -> str:
    """HASH engine block hash -> request key, for `pod`."""
    return f"{PREFIX}pod:{pod}:ehash"


def pod_key_dups_key(pod: str) -> str:
    """HASH request key -> how many more of `pod`'s engine hashes map to it than one."""
    return f"{PREFIX}pod:{pod}:kdup"


def pod_seq_key(pod: str) -> str:
    """Last KV-event batch sequence number applied to the index for `pod`."""
    return f"{PREFIX}pod:{pod}:seq"


def pod_ts_key(pod: str) -> str:
    """Timestamp of that batch: tells a restarted engine (seq back, newer time) from
    a batch seen twice (seq back, same or older time)."""
    return f"{PREFIX}pod:{pod}:ts"


def pod_sync_key(pod: str) -> str:
    """HASH owner / until: the fence of a gateway rewriting `pod`'s entries."""
    return f"{PREFIX}pod:{pod}:sync"


def pod_meta_key(pod: str) -> str:
    """HASH block_size / model / pool / namespace / topic of `pod`."""
    return f"{PREFIX}pod:{pod}:meta"


def load_key(pod: str) -> str:
    """HASH waiting / running / kv_usage / ts_ms of `pod`, with a short TTL."""
    return f"{PREFIX}load:{pod}"


def pool_pods_key(namespace: str, pool: str) -> str:
    """SET of pod ids that gateways currently route to in `namespace/pool`."""
    assert "/" not in namespace, namespace
    return f"{PREFIX}pool:{namespace}/{pool}:pods"


def engine_hash_field(block_hash: bytes | int) -> str:
    """Field name of an engine block hash in `pod_hashes_key` (int: decimal, bytes: hex)."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    assert isinstance(block_hash, int), type(block_hash)
    return str(block_hash)


def parse_load(fields: dict[Any, Any]) -> dict[str, float] | None:
    """Decode a `load_key` HASH (bytes or str) into floats; None if empty/partial."""
    if not fields:
        return None
    out: dict[str, float] = {}
    for name in LOAD_FIELDS:
        raw = fields.get(name, fields.get(name.encode()))
        if raw is None:
            return None
        out[name] = float(raw)
    return out


def _pod_key_batches(client: Any, pod: str) -> Iterable[list[Any]]:
    cursor = 0
    while True:
        cursor, keys = client.sscan(pod_keys_key(pod), cursor, count=_SCAN_BATCH)
        if keys:
            yield list(keys)
        if int(cursor) == 0:
            return


def purge_pods(redis_client: Any, pods: list[str], index_only: bool = False) -> int:
    """Remove every index and load entry of `pods` from Redis.

    Removes each pod from the holders of every key it held, deletes its
    per-pod keys (speculative entries included), its
    load entry, and its membership of the pool set named in its meta; with
    `index_only`, only the prefix-index entries (keys, hashes and their counts,
    seq, speculative entries, a rewrite's fence), so its registration and load stay. Works in
    SSCAN batches so a pod with millions of keys never blocks Redis. Idempotent.
    Returns the number of request keys the pods held. `redis_client` is a sync
    `redis.Redis`.
    """
    total = 0
    for pod in pods:
        meta = redis_client.hgetall(pod_meta_key(pod)) or {}
        for keys in _pod_key_batches(redis_client, pod):
            pipe = redis_client.pipeline(transaction=False)
            for k in keys:
                k = k.decode() if isinstance(k, bytes) else k
                pipe.srem(block_key(k), pod)
            pipe.execute()
            total += len(keys)
        index_entries = (pod_keys_key(pod), pod_hashes_key(pod), pod_key_dups_key(pod),
                         pod_seq_key(pod), pod_ts_key(pod), pod_spec_key(pod),
                         pod_sync_key(pod))
        if index_only:
            redis_client.delete(*index_entries)
            continue
        ns = meta.get(b"namespace", meta.get("namespace"))
        pool = meta.get(b"pool", meta.get("pool"))
        pipe = redis_client.pipeline(transaction=False)
        if ns is not None and pool is not None:
            ns = ns.decode() if isinstance(ns, bytes) else ns
            pool = pool.decode() if isinstance(pool, bytes) else pool
            pipe.srem(pool_pods_key(ns, pool), pod)
        pipe.delete(*index_entries, pod_meta_key(pod), load_key(pod))
        pipe.execute()
    return total
