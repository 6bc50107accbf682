"""Pod load: the latest figures per pod from each engine's `/metrics` (vLLM names).

An entry older than its TTL is unknown: routing does not prefer such a pod.
`scrape.LoadScraper` fills the table and shares it through Redis.
"""

from __future__ import annotations

from sluice.metrics_text import EngineMetrics


class LoadTable:
    """Latest load per pod with its timestamp: this replica's own scrapes, and the
    entries Redis held at its last scrape (`put_shared`: another replica's may be
    newer), so replicas that route on their own view read the shared figures too."""

    def __init__(self, ttl_ms: int) -> None:
        assert ttl_ms > 0
        self.ttl_ms = ttl_ms
        self._rows: dict[str, tuple[float, EngineMetrics]] = {}
        self._shared: dict[str, dict[str, float]] = {}

    def put(self, pod: str, m: EngineMetrics, ts_ms: float) -> None:
        self._rows[pod] = (ts_ms, m)

    def put_shared(self, pod: str, row: dict[str, float] | None) -> None:
        """Redis's load entry of `pod` (fields `LOAD_FIELDS`; None: it has none)."""
        if row is None:
            self._shared.pop(pod, None)
        else:
            self._shared[pod] = row

    def drop(self, pod: str) -> None:
        self._rows.pop(pod, None)
        self._shared.pop(pod, None)

    def metrics(self, pod: str) -> EngineMetrics | None:
        row = self._rows.get(pod)
        return None if row is None else row[1]

    def row(self, pod: str, now_ms: float) -> dict[str, float] | None:
        """The pod's unexpired load, shaped like a Redis load entry: the newer of its own
        scrape and Redis's entry; None when neither is fresh. O(1): a request reads the
        pods it considers, not the table."""
        own, shared = self._rows.get(pod), self._shared.get(pod)
        row = shared
        if own is not None and (shared is None or own[0] >= shared["ts_ms"]):
            ts, m = own
            row = {"waiting": m.waiting, "running": m.running, "kv_usage": m.kv_usage,
                   "ts_ms": ts}
        return row if row is not None and now_ms - row["ts_ms"] < self.ttl_ms else None

    def fresh(self, now_ms: float) -> dict[str, dict[str, float]]:
        """`row` of every pod that has a fresh one."""
        rows = {pod: self.row(pod, now_ms) for pod in {*self._rows, *self._shared}}
        return {pod: row for pod, row in rows.items() if row is not None}
