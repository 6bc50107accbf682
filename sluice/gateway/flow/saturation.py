"""Is a pool saturated? GIE's saturation detector, on the picker's load rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.gateway.flow.fields import ConfigError, check_fields, duration_s

UTILIZATION_DETECTOR = "utilization-detector"  # GIE v1.5's plugin type of these thresholds


@dataclass(frozen=True)
class SaturationDetectorConfig:
    """GIE v1.4's `saturationDetector:` section; GIE v1.5 moved the same fields, with the
    same defaults, to the `parameters` of a `utilization-detector` plugin (`from_epp`)."""

    queue_depth_threshold: int = 5        # waiting requests a pod may hold and take more
    kv_cache_util_threshold: float = 0.8  # KV-cache usage, 0..1, a pod may hold and take more
    # GIE scrapes every 50 ms; older rows may hide a pod that has filled up since.
    metrics_staleness_threshold_s: float = 0.2

    FIELDS = ("queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold")

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
        return cls(**kw)

    @classmethod
    def from_epp(cls, epp: dict[str, Any]) -> SaturationDetectorConfig:
        """From a whole EndpointPickerConfig: v1.4's inline section, or v1.5's
        `saturationDetector: {pluginRef}` naming a `utilization-detector` plugin (absent:
        the plugin named `utilization-detector`, if any, else the defaults)."""
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
                if spec.get("type") != UTILIZATION_DETECTOR:
                    raise ConfigError(f"saturationDetector.pluginRef {ref!r}: type "
                                     f"{spec.get('type')!r} is not supported; known types: "
                                     f"{UTILIZATION_DETECTOR}")
                return cls.from_dict(spec.get("parameters"))
        if required:
            raise ConfigError(f"saturationDetector.pluginRef {ref!r}: no such plugin")
        return cls()


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
