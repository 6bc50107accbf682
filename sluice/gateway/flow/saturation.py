"""Is a pool saturated? GIE's saturation detector, on the picker's load rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.gateway.flow.fields import ConfigError, check_fields, duration_s

UTILIZATION_DETECTOR = "utilization-detector"  # GIE v1.5's plugin type of these thresholds
CONCURRENCY_DETECTOR = "concurrency-detector"


@dataclass(frozen=True)
class SaturationDetectorConfig:
    """GIE v1.4's `saturationDetector:` section; GIE v1.5 moved the same fields, with the
    same defaults, to the `parameters` of a `utilization-detector` plugin (`from_epp`)."""

    queue_depth_threshold: int = 5        # waiting requests a pod may hold and take more
    kv_cache_util_threshold: float = 0.8  # KV-cache usage, 0..1, a pod may hold and take more
    # GIE scrapes every 50 ms; older rows may hide a pod that has filled up since.
    metrics_staleness_threshold_s: float = 0.2
    headroom: float = 0.0  # (as a profile's filter: how far past the thresholds a pod may go)

    FIELDS = ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold",
              "headroom")

    def __post_init__(self) -> None:
        assert self.queue_depth_threshold > 0, self.queue_depth_threshold
        assert 0.0 < self.kv_cache_util_threshold <= 1.0, self.kv_cache_util_threshold
        assert self.metrics_staleness_threshold_s > 0, self.metrics_staleness_threshold_s

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SaturationDetectorConfig:
        """From GIE's camelCase fields; an unknown field or a bad value is a ValueError."""
        d = check_fields(d, cls.FIELDS, "saturationDetector")
        kw: dict[str, Any] = {}
        if "queueDepthThreshold" in d:
            v = d["queueDepthThreshold"]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"saturationDetector.queueDepthThreshold: a positive "
                                 f"integer, got {v!r}")
            kw["queue_depth_threshold"] = v
        if "kvCacheUtilThreshold" in d:
            v = d["kvCacheUtilThreshold"]
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
                raise ConfigError(f"saturationDetector.kvCacheUtilThreshold: in (0, 1], "
                                 f"got {v!r}")
            kw["kv_cache_util_threshold"] = float(v)
        if "metricsStalenessThreshold" in d:
            where = "saturationDetector.metricsStalenessThreshold"
            s = duration_s(d["metricsStalenessThreshold"], where)
            if s <= 0:
                raise ConfigError(f"{where}: must be positive, got {s}s")
            kw["metrics_staleness_threshold_s"] = s
        if "headroom" in d:
            v = d["headroom"]
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ConfigError(f"saturationDetector.headroom: >= 0, got {v!r}")
            kw["headroom"] = float(v)
        return cls(**kw)

    @classmethod
    def from_epp(cls, epp: dict[str, Any]) -> SaturationDetectorConfig | ConcurrencyDetectorConfig:
        """From a whole EndpointPickerConfig: v1.4's inline section, or v1.5's
        `saturationDetector: {pluginRef}` naming a `utilization-detector` or
        `concurrency-detector` plugin (absent: the plugin named `utilization-detector`,
        if any, else the defaults)."""
        section = epp.get("saturationDetector") or {}
        if "pluginRef" not in section:
            if section:
                return cls.from_dict(section)
            ref, required = UTILIZATION_DETECTOR, False
        else:
            check_fields(section, ("pluginRef",), "saturationDetector")
            ref, required = section["pluginRef"], True
        for spec in epp.get("plugins") or ():
            if spec.get("name", spec.get("type")) == ref:
                if spec.get("type") == CONCURRENCY_DETECTOR:
                    return ConcurrencyDetectorConfig.from_dict(spec.get("parameters"))
                if spec.get("type") != UTILIZATION_DETECTOR:
                    raise ConfigError(f"saturationDetector.pluginRef {ref!r}: type "
                                     f"{spec.get('type')!r} is not supported; known types: "
                                     f"{UTILIZATION_DETECTOR}, {CONCURRENCY_DETECTOR}")
                return cls.from_dict(spec.get("parameters"))
        if required:
            raise ConfigError(f"saturationDetector.pluginRef {ref!r}: no such plugin")
        return cls()


@dataclass(frozen=True)
class ConcurrencyDetectorConfig:
    """GIE's `concurrency-detector` (requests mode): a pool's saturation is the requests in
    flight to it over its capacity, `maxConcurrency` per pod."""

    max_concurrency: int = 100
    headroom: float = 0.0  # (as a profile's filter: how far past maxConcurrency a pod may go)

    FIELDS = ("concurrencyMode", "maxConcurrency", "maxTokenConcurrency", "headroom",
              "inFlightLoadProducerName")

    def __post_init__(self) -> None:
        assert self.max_concurrency > 0 and self.headroom >= 0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ConcurrencyDetectorConfig:
        d = check_fields(d, cls.FIELDS, CONCURRENCY_DETECTOR)
        if d.get("concurrencyMode", "requests") != "requests":
            raise ConfigError(f"{CONCURRENCY_DETECTOR}.concurrencyMode: only 'requests' "
                             f"is supported, got {d['concurrencyMode']!r}")
        kw: dict[str, Any] = {}
        v = d.get("maxConcurrency", 100)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{CONCURRENCY_DETECTOR}.maxConcurrency: a positive integer, "
                             f"got {v!r}")
        kw["max_concurrency"] = v
        h = d.get("headroom", 0.0)
        if isinstance(h, bool) or not isinstance(h, int | float) or h < 0:
            raise ConfigError(f"{CONCURRENCY_DETECTOR}.headroom: >= 0, got {h!r}")
        kw["headroom"] = float(h)
        return cls(**kw)

    def score(self, inflight: int, pods: int) -> float:
        """`inflight` requests over the capacity of `pods` pods; 1 for no pod at all."""
        return inflight / (pods * self.max_concurrency) if pods else 1.0


class SaturationDetector:
    """GIE's rule (`saturationdetector.IsSaturated`): a pool is saturated when no
    candidate pod has capacity. A pod has capacity when its load row is fresh (no older
    than `metrics_staleness_threshold`) and it holds at most `queue_depth_threshold`
    waiting requests and at most `kv_cache_util_threshold` KV-cache usage (GIE's bounds
    are inclusive: a pod is over when it exceeds them). A pod with no row, or a stale one,
    has no capacity: an unobserved pod may be full. An empty candidate list is saturated.

    Rows are the picker's load rows, `{"waiting", "running", "kv_usage", "ts_ms"}` or
    None; `running` plays no part, as in GIE."""

    def __init__(self, config: SaturationDetectorConfig = SaturationDetectorConfig()) -> None:
        self.config = config
        self._stale_ms = config.metrics_staleness_threshold_s * 1000.0

    def has_capacity(self, row: dict[str, float] | None, now_ms: float) -> bool:
        if row is None or now_ms - row["ts_ms"] > self._stale_ms:
            return False
        return (row["waiting"] <= self.config.queue_depth_threshold
                and row["kv_usage"] <= self.config.kv_cache_util_threshold)

    def saturated(self, rows: Sequence[dict[str, float] | None], now_ms: float) -> bool:
        return not any(self.has_capacity(row, now_ms) for row in rows)

    def score(self, rows: Sequence[dict[str, float] | None], now_ms: float) -> float:
        """GIE v1.5's saturation: the mean over pods of max(waiting / queue threshold, KV
        usage / KV threshold), 1 for a pod whose load is unknown or stale; 1 for no pod."""
        if not rows:
            return 1.0
        c, total = self.config, 0.0
        for row in rows:
            if row is None or now_ms - row["ts_ms"] > self._stale_ms:
                total += 1.0
            else:
                total += max(row["waiting"] / c.queue_depth_threshold,
                             row["kv_usage"] / c.kv_cache_util_threshold)
        return total / len(rows)
