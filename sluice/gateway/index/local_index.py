"""Bounded in-memory view of the prefix index (one per gateway replica).

Holds the same facts as the Redis index: request key -> pods holding it,
pod -> {engine block hash field -> request key}, pod -> {request key -> number
of its engine hashes mapping to it} (blocks with the same tokens and parent
under another LoRA, multimodal input or cache salt share a key: the pod holds
it until the last of them is gone), and speculative entries with an expiry.
Every gateway replica feeds it from the engines' events, so when Redis is
unreachable routing continues on it (approximately: it is bounded,
least-recently-used keys are dropped first). Thread-safe: the event feeder
thread writes while request handlers read. Holders are tuples of pod ids, not
sets: tuples of strings are untracked by Python's cyclic GC, so a view with a
million keys adds no GC pauses to the request path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalIndexConfig:
    max_keys: int = 1_000_000          # confirmed request keys kept (LRU beyond)
    max_hashes_per_pod: int = 2_000_000  # engine hashes tracked per pod
    max_speculative_keys: int = 200_000

    def __post_init__(self) -> None:
        assert self.max_keys > 0 and self.max_hashes_per_pod > 0
        assert self.max_speculative_keys > 0


class LocalIndex:
    def __init__(self, config: LocalIndexConfig = LocalIndexConfig()) -> None:
        self.config = config
        self._holders: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._pod_hashes: dict[str, dict[str, str]] = {}
        # pod -> key -> its fields in _pod_hashes[pod] (> 0); holders are a bounded
        # cache of the keys with a count, so a key may lack a holder entry, not the
        # reverse
        self._counts: dict[str, dict[str, int]] = {}
        self._spec: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped = 0  # stores refused because a bound was hit

    # -- writes (event feeder) ---------------------------------------------------------
    def store(self, pod: str, pairs: list[tuple[str, str]]) -> None:
        """Record that `pod` holds blocks: (engine hash field, request key) pairs. A
        field stored again with the same key changes no count; with another key,
        it counts for that key instead."""
        with self._lock:
            hashes = self._pod_hashes.setdefault(pod, {})
            counts = self._counts.setdefault(pod, {})
            for field, key in pairs:
                old = hashes.get(field)
                if old is None and len(hashes) >= self.config.max_hashes_per_pod:
                    self.dropped += 1
                    continue
                if old != key:
                    if old is not None:
                        self._release(pod, counts, old)
                    hashes[field] = key
                    counts[key] = counts.get(key, 0) + 1
                self._hold(key, pod)

    def remove(self, pod: str, fields: list[str]) -> None:
        """`pod` evicted the blocks with these engine hash fields."""
        with self._lock:
            hashes = self._pod_hashes.get(pod, {})
            counts = self._counts.get(pod, {})
            for field in fields:
                key = hashes.pop(field, None)
                if key is not None:
                    self._release(pod, counts, key)

    def clear(self, pod: str) -> None:
        """`pod` dropped its whole cache (AllBlocksCleared) or is gone."""
        with self._lock:
            self._pod_hashes.pop(pod, None)
            for key in self._counts.pop(pod, {}):
                self._discard(key, pod)
            for holders in self._spec.values():
                holders.pop(pod, None)

    def add_speculative(self, pod: str, keys: list[str], expiry_ms: float) -> None:
        """`pod` will hold `keys` until `expiry_ms` (an entry's expiry only grows)."""
        with self._lock:
            for key in keys:
                holders = self._spec.setdefault(key, {})
                holders[pod] = max(holders.get(pod, 0.0), expiry_ms)
                self._spec.move_to_end(key)
            while len(self._spec) > self.config.max_speculative_keys:
                self._spec.popitem(last=False)

    def _hold(self, key: str, pod: str) -> None:
        """`pod` holds `key` (again, if the LRU bound had dropped its entry)."""
        pods = self._holders.get(key)
        if pods is None:
            self._holders[key] = (pod,)
            if len(self._holders) > self.config.max_keys:
                self._holders.popitem(last=False)
                self.dropped += 1
        elif pod not in pods:
            self._holders[key] = (*pods, pod)

    def _release(self, pod: str, counts: dict[str, int], key: str) -> None:
        """One engine hash of `pod` less maps to `key`; the last one takes the key."""
        assert counts.get(key, 0) > 0, (pod, key)
        n = counts[key] - 1
        if n:
            counts[key] = n
        else:
            del counts[key]
            self._discard(key, pod)

    def _discard(self, key: str, pod: str) -> None:
        pods = self._holders.get(key)
        if pods is not None and pod in pods:
            rest = tuple(p for p in pods if p != pod)
            if rest:
                self._holders[key] = rest
            else:
                del self._holders[key]

    # -- reads -------------------------------------------------------------------------
    def key_of(self, pod: str, field: str) -> str | None:
        with self._lock:
            return self._pod_hashes.get(pod, {}).get(field)

    def snapshot(self, pod: str) -> dict[str, str]:
        """Copy of the pod's engine-hash -> key map (to re-sync Redis from)."""
        with self._lock:
            return dict(self._pod_hashes.get(pod, {}))

    def pods(self) -> list[str]:
        with self._lock:
            return list(self._pod_hashes)

    def held(self, pods: list[str]) -> dict[str, int]:
        """Per pod the number of keys it holds (confirmed by its events)."""
        with self._lock:
            return {p: len(self._counts.get(p, ())) for p in pods}

    def with_speculative(self, keys: list[str], hits: dict[str, int], pods: list[str],
                         now_ms: float) -> dict[str, int]:
        """`hits` (pod -> leading `keys` held, as another source such as Redis
        found them) extended by this view's unexpired speculative entries: each
        pod's run goes on while the next key is speculatively its own. This is
        how a replica sees its own latest decisions before they reach Redis."""
        out = dict(hits)
        with self._lock:
            if not self._spec:
                return out
            for p in pods:
                i = hits.get(p, 0)
                while i < len(keys):
                    spec = self._spec.get(keys[i])
                    if spec is None or spec.get(p, 0) <= now_ms:
                        break
                    i += 1
                if i:
                    out[p] = i
        return out

    def lookup(self, keys: list[str], pods: list[str], now_ms: float) -> dict[str, int]:
        """For each of `pods`, the number of leading `keys` it holds consecutively
        (confirmed or unexpired speculative). Pods with no hit are absent."""
        hits: dict[str, int] = {}
        alive = set(pods)
        with self._lock:
            for i, key in enumerate(keys):
                holding = self._holders.get(key, ())
                spec = self._spec.get(key)
                if holding:
                    self._holders.move_to_end(key)
                alive = {p for p in alive if p in holding
                         or (spec is not None and spec.get(p, 0) > now_ms)}
                if not alive:
                    break
                for p in alive:
                    hits[p] = i + 1
        return hits
