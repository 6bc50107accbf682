"""llm-d's disaggregating profile handlers: `disagg-profile-handler` and its older form
`pd-profile-handler`.

The decode profile runs first and names the destination (a decode-capable pod: its
`decode-filter`). When the request's pool has prefill pods and the decider says so
(`deciders.py`; given the decode target's predicted hits), the prefill profile runs
(its `prefill-filter`) and its target is named in `x-prefiller-host-port`; the decode
engine fetches the prompt's KV from there. With no healthy prefill pod the decode pod
prefills (never a failed request for want of a prefill pod). A pool without prefill
pods routes on the decode profile alone, with no header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest, SchedulingResult
from sluice.gateway.routing.profiles.deciders import ThresholdDecider
from sluice.gateway.routing.registry import PluginError, plugin

# outcomes (metrics labels and the x-sluice-pd response header)
NO_ROLES, PREFILLED, SHORT, NO_PREFILL_POD = "none", "prefill", "short", "no_prefill_pod"


class DisaggHandler:
    """See the module docstring. `decider_ref`: the decider plugin's name, resolved by
    the configuration into `decider`; None: P/D off (or `decider` set already)."""

    decode: str
    prefill: str
    decider_ref: str | None
    decider: object | None = None

    def bind(self, profiles: list[str]) -> None:
        need = [self.decode] + ([self.prefill] if self.decider_ref or self.decider else [])
        if missing := [p for p in need if p not in profiles]:
            raise PluginError(f"{self.name} needs the profiles {', '.join(missing)}; "
                              f"configured: {', '.join(profiles)}")

    def disaggregate(self, req: RoutingRequest, target) -> bool:
        return self.decider is not None and self.decider.disaggregate(req, target)

    def pick_profiles(self, req: RoutingRequest, profiles: Mapping[str, object],
                      results: Mapping[str, ProfileResult | None]) -> list[str]:
        if not results:
            return [self.decode]
        d = results.get(self.decode)
        if (self.prefill in results or d is None or PREFILL not in req.pool_roles
                or not self.disaggregate(req, d.target)):
            return []
        return [self.prefill]

    def process_results(self, req: RoutingRequest,
                        results: Mapping[str, ProfileResult | None]) -> SchedulingResult:
        if PREFILL not in req.pool_roles:
            outcome = NO_ROLES
        elif self.prefill not in results:
            outcome = SHORT
        elif results[self.prefill] is None:
            outcome = NO_PREFILL_POD
        else:
            return SchedulingResult(results, self.decode, self.prefill, PREFILLED)
        return SchedulingResult(results, self.decode, None, outcome)


@dataclass(frozen=True)
class DisaggParams:
    profiles: dict = field(default_factory=dict)  # {decode, prefill, encode}: profile names
    deciders: dict = field(default_factory=dict)  # {prefill, encode}: decider plugin names
    stage_order: str = "decode-first"
    # the older flat form (not mixed with the nested one)
    decode_profile: str | None = None
    prefill_profile: str | None = None
    prefill_decider_plugin_name: str | None = None
    decider_plugin_name: str | None = None
    encode_profile: str | None = None
    encode_decider_plugin_name: str | None = None


@plugin("disagg-profile-handler", DisaggParams)
class DisaggProfileHandler(DisaggHandler):
    """See the module docstring. Without `deciders.prefill` every request is decoded
    where the decode profile says (P/D off). Encode stages are not served."""

    def __init__(self, name: str, params: DisaggParams, ctx: PluginContext) -> None:
        self.name = name
        p = params
        flat = (p.decode_profile, p.prefill_profile, p.prefill_decider_plugin_name,
                p.decider_plugin_name, p.encode_profile, p.encode_decider_plugin_name)
        if any(v is not None for v in flat) and (p.profiles or p.deciders):
            raise PluginError(f"{name}: the nested parameters (profiles, deciders) and "
                              "the flat ones cannot be mixed")
        if p.stage_order != "decode-first":
            raise PluginError(f"{name}: stageOrder {p.stage_order!r} is not supported; "
                              "known: decode-first")
        if p.deciders.get("encode") or p.encode_decider_plugin_name:
            raise PluginError(f"{name}: encode stages are not supported")
        self.decode = p.profiles.get("decode") or p.decode_profile or "decode"
        self.prefill = p.profiles.get("prefill") or p.prefill_profile or "prefill"
        self.decider_ref = (p.deciders.get("prefill") or p.prefill_decider_plugin_name
                            or p.decider_plugin_name)


@dataclass(frozen=True)
class PDParams:
    decode_profile: str = "decode"
    prefill_profile: str = "prefill"
    decider_plugin_name: str | None = None  # default: the plugin prefix-based-pd-decider
    threshold: int | None = None  # llm-d <= 0.3: instead of a decider (0: always P/D)
    primary_port: int = 0
    # the prefix producer (the plan has one) and the block size it hashed with
    IGNORED = ("hashBlockSize", "prefixPluginName", "prefixPluginType",
               "prefixMatchInfoProducerName")

    def __post_init__(self) -> None:
        assert self.threshold is None or self.threshold >= 0


@plugin("pd-profile-handler", PDParams)
class PDProfileHandler(DisaggHandler):
    """See the module docstring. The decider: `deciderPluginName`; else llm-d 0.3's
    `threshold` rule; else the plugin named prefix-based-pd-decider when configured,
    and without it llm-d 0.3's default (threshold 0: always disaggregate)."""

    def __init__(self, name: str, params: PDParams, ctx: PluginContext) -> None:
        self.name, self.decode, self.prefill = name, params.decode_profile, params.prefill_profile
        if params.primary_port:
            raise PluginError(f"{name}: primaryPort (data-parallel ports) is not supported")
        self.decider_ref = params.decider_plugin_name
        if self.decider_ref is None and params.threshold is not None:
            self.decider = ThresholdDecider(params.threshold)
        elif self.decider_ref is None:
            self.decider = ThresholdDecider(0)
            self.optional_decider_ref = "prefix-based-pd-decider"
