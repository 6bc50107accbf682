"""Pod load: the latest figures per pod from each engine's `/metrics` (vLLM names).

An entry older than its TTL is unknown: routing does not prefer such a pod.
`scrape.LoadScraper` fills the table and shares it through Redis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_hits: float = 0.0      # tokens (counter)
    prefix_queries: float = 0.0   # tokens (counter)


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Read the vLLM metrics routing needs from a Prometheus text exposition.
    Counts are summed over series (`model_name`, `engine` label values); the
    KV-usage fraction is their mean (vLLM exports one series per engine of a
    data-parallel server, each a fraction of its own cache)."""
    vals: dict[str, float] = {}
    series: dict[str, int] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name == "vllm:cache_config_info":
            info = dict(_LABEL.findall(labels))
            continue
        vals[name] = vals.get(name, 0.0) + v
        series[name] = series.get(name, 0) + 1
    kv = 0.0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if name in vals:
            kv = vals[name] / series[name]
            break

    def as_int(s: str | None) -> int | None:
        return int(s) if s and s.isdigit() else None

    return EngineMetrics(
        waiting=vals.get("vllm:num_requests_waiting", 0.0),
        running=vals.get("vllm:num_requests_running", 0.0), kv_usage=kv,
        block_size=as_int(info.get("block_size")),
        num_gpu_blocks=as_int(info.get("num_gpu_blocks")),
        prefix_hits=vals.get("vllm:prefix_cache_hits_total", 0.0),
        prefix_queries=vals.get("vllm:prefix_cache_queries_total", 0.0))


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

    def fresh(self, now_ms: float) -> dict[str, dict[str, float]]:
        """Unexpired loads, shaped like the Redis load entries: per pod the newer of
        its own scrape and Redis's entry."""
        out = {pod: {"waiting": m.waiting, "running": m.running, "kv_usage": m.kv_usage,
                     "ts_ms": ts} for pod, (ts, m) in self._rows.items()}
        for pod, row in self._shared.items():
            if pod not in out or row["ts_ms"] > out[pod]["ts_ms"]:
                out[pod] = row
        return {pod: row for pod, row in out.items() if now_ms - row["ts_ms"] < self.ttl_ms}
