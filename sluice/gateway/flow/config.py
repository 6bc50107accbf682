"""Flow control's knobs: GIE's `flowControl:` section, with GIE's names and defaults.

Each limit holds per pool: GIE runs one endpoint picker, so one flow controller, per
InferencePool; Sluice's picker serves several pools and keeps each pool's queues apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sluice.gateway.flow.fields import ConfigError, check_fields, duration_s, quantity

ROUND_ROBIN = "round-robin-fairness-policy"
GLOBAL_STRICT = "global-strict-fairness-policy"
FCFS = "fcfs-ordering-policy"
# GIE's plugin type names (the default instance names), and their short forms.
FAIRNESS = {ROUND_ROBIN: ROUND_ROBIN, "round-robin": ROUND_ROBIN,
            GLOBAL_STRICT: GLOBAL_STRICT, "global-strict": GLOBAL_STRICT}
ORDERING = {FCFS: FCFS, "fcfs": FCFS}
DEFAULT_BAND_MAX_BYTES = 1_000_000_000  # GIE's defaultPriorityBandMaxBytes


@dataclass(frozen=True)
class PriorityBandConfig:
    """The queues of one priority. 0 in a limit: none (GIE's meaning)."""

    priority: int = 0
    max_bytes: int = DEFAULT_BAND_MAX_BYTES  # request bodies queued in this band
    max_requests: int = 0                    # requests queued in this band
    # GIE's default is global-strict (FCFS across the band); Sluice shares a band between
    # tenants by default, so that one tenant's flood cannot starve the others.
    fairness_policy: str = ROUND_ROBIN
    ordering_policy: str = FCFS              # within a tenant (the only one Sluice has)

    FIELDS = ("priority", "maxBytes", "maxRequests", "fairnessPolicyRef", "orderingPolicyRef")

    def __post_init__(self) -> None:
        assert self.max_bytes >= 0 and self.max_requests >= 0
        assert self.fairness_policy in (ROUND_ROBIN, GLOBAL_STRICT), self.fairness_policy
        assert self.ordering_policy == FCFS, self.ordering_policy

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, where: str) -> PriorityBandConfig:
        """GIE's `PriorityBandConfig` fields over the defaults."""
        d = check_fields(d, cls.FIELDS, where)
        band = cls()
        kw: dict[str, Any] = {}
        if "priority" in d:
            if isinstance(d["priority"], bool) or not isinstance(d["priority"], int):
                raise ConfigError(f"{where}.priority: an integer, got {d['priority']!r}")
            kw["priority"] = d["priority"]
        if "maxBytes" in d:
            kw["max_bytes"] = quantity(d["maxBytes"], f"{where}.maxBytes")
        if "maxRequests" in d:
            kw["max_requests"] = quantity(d["maxRequests"], f"{where}.maxRequests")
        for key, names, attr in (("fairnessPolicyRef", FAIRNESS, "fairness_policy"),
                                 ("orderingPolicyRef", ORDERING, "ordering_policy")):
            if d.get(key):
                if d[key] not in names:
                    raise ConfigError(f"{where}.{key}: unknown policy {d[key]!r}; known: "
                                     + ", ".join(names))
                kw[attr] = names[d[key]]
        return replace(band, **kw)


@dataclass(frozen=True)
class FlowControlConfig:
    """GIE's `FlowControlConfig`, plus Sluice's dispatcher knobs. 0 in a limit: none."""

    max_bytes: int = 0     # request bodies queued in a pool, all priorities
    max_requests: int = 0  # requests queued in a pool, all priorities
    # How long a request may wait in a queue (then 503). 0: until the client goes away.
    default_request_ttl_s: float = 0.0
    default_priority_band: PriorityBandConfig = field(default_factory=PriorityBandConfig)
    priority_bands: tuple[PriorityBandConfig, ...] = ()
    # --- Sluice's own (camelCase in from_dict) ---
    # Saturation is re-checked this often while requests wait, besides on notify(): a
    # finished request frees room at once; scraped load changes only every 50 ms or so.
    poll_interval_s: float = 0.01
    # A request of negative priority is "sheddable": refused at once (429) while the pool
    # is saturated, rather than queued, as GIE's flow control did through v1.2 and its
    # admission without flow control still does. False: it queues in its own band, below
    # priority 0, as GIE's flow control does from v1.3.
    shed_sheddable: bool = True
    max_retry_after_s: int = 60  # the longest Retry-After a shed request is told
    # The usage limit: a request of a priority is dispatched while the pool's saturation
    # is below its ceiling. static-usage-limit-policy: `usage_threshold` for every
    # priority; priority-holdback-policy (`holdback_min` set): linear over the ranks of
    # the configured priorities, from 1.0 (`holdback_max`) at the highest to holdback_min
    # at the lowest, so lower priorities stop while higher ones still have room.
    usage_threshold: float = 1.0
    holdback_min: float | None = None
    holdback_max: float = 1.0

    FIELDS = ("maxBytes", "maxRequests", "defaultRequestTTL", "defaultPriorityBand",
              "priorityBands", "usageLimitPolicyPluginRef",
              "pollInterval", "shedSheddable", "maxRetryAfter")

    def __post_init__(self) -> None:
        assert self.max_bytes >= 0 and self.max_requests >= 0
        assert self.default_request_ttl_s >= 0 and self.poll_interval_s > 0
        assert self.max_retry_after_s >= 1
        priorities = [b.priority for b in self.priority_bands]
        assert len(set(priorities)) == len(priorities), f"priorities twice: {priorities}"
        assert 0 < self.usage_threshold <= 1.0 and 0 < self.holdback_max <= 1.0
        assert self.holdback_min is None or 0 < self.holdback_min <= self.holdback_max

    def ceiling(self, priority: int) -> float:
        """The saturation below which a request of `priority` is dispatched."""
        if self.holdback_min is None:
            return self.usage_threshold
        ranks = sorted({b.priority for b in self.priority_bands} | {priority}, reverse=True)
        if len(ranks) == 1:
            return self.holdback_max
        i = ranks.index(priority)
        return self.holdback_max - i * (self.holdback_max - self.holdback_min) / (len(ranks) - 1)

    def band(self, priority: int) -> PriorityBandConfig:
        """The configured band of `priority`, else the default band's template."""
        for b in self.priority_bands:
            if b.priority == priority:
                return b
        return replace(self.default_priority_band, priority=priority)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FlowControlConfig:
        """From GIE's camelCase fields (durations "30s", quantities "1k"/"1Gi"); an
        unknown field or policy is a ValueError that lists the known ones."""
        d = check_fields(d, cls.FIELDS, "flowControl")
        kw: dict[str, Any] = {}
        for key, attr in (("maxBytes", "max_bytes"), ("maxRequests", "max_requests")):
            if key in d:
                kw[attr] = quantity(d[key], f"flowControl.{key}")
        for key, attr in (("defaultRequestTTL", "default_request_ttl_s"),
                          ("pollInterval", "poll_interval_s")):
            if key in d:
                kw[attr] = duration_s(d[key], f"flowControl.{key}")
                if kw[attr] < 0 or (attr == "poll_interval_s" and kw[attr] == 0):
                    raise ConfigError(f"flowControl.{key}: out of range: {d[key]!r}")
        if d.get("usageLimitPolicyPluginRef"):
            raise ConfigError("flowControl.usageLimitPolicyPluginRef: name a configured "
                             "static-usage-limit-policy or priority-holdback-policy plugin")
        if "shedSheddable" in d:
            if not isinstance(d["shedSheddable"], bool):
                raise ConfigError(f"flowControl.shedSheddable: true or false, "
                                 f"got {d['shedSheddable']!r}")
            kw["shed_sheddable"] = d["shedSheddable"]
        if "maxRetryAfter" in d:
            kw["max_retry_after_s"] = max(1, round(duration_s(d["maxRetryAfter"],
                                                              "flowControl.maxRetryAfter")))
        default = PriorityBandConfig.from_dict(d.get("defaultPriorityBand"),
                                               "flowControl.defaultPriorityBand")
        kw["default_priority_band"] = default
        bands = []
        for i, b in enumerate(d.get("priorityBands") or ()):
            where = f"flowControl.priorityBands[{i}]"
            if not isinstance(b, dict) or "priority" not in b:
                raise ConfigError(f"{where}: a mapping with a priority")
            # (GIE: a listed band's unset fields take the system defaults, not the
            # default band's: that one is the template of the priorities left unlisted)
            bands.append(PriorityBandConfig.from_dict(b, where))
        seen = [b.priority for b in bands]
        if len(set(seen)) != len(seen):
            raise ConfigError(f"flowControl.priorityBands: a priority twice: {seen}")
        kw["priority_bands"] = tuple(bands)
        return cls(**kw)
