"""An EndpointPickerConfig's `saturationDetector` and `flowControl` sections, read with
the plugins they name (`flow_policies.py`) into `flow`'s configurations."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from sluice.gateway.flow.config import FlowControlConfig
from sluice.gateway.flow.saturation import ConcurrencyDetectorConfig, SaturationDetectorConfig
from sluice.gateway.routing.registry import PluginError

log = logging.getLogger("sluice.gateway.routing")

_BAND_REFS = ("fairnessPolicyRef", "orderingPolicyRef")


def flow_sections(doc: Mapping[str, Any], plugins: Mapping[str, object], enabled: bool
                  ) -> tuple[SaturationDetectorConfig | ConcurrencyDetectorConfig,
                             FlowControlConfig | None]:
    """(The saturation detector's configuration; flow control's, or None when the
    `flowControl` feature gate is off, as llm-d and GIE leave the section unread then).
    A plugin reference names a configured plugin, or a type by its default name."""
    flow = copy.deepcopy(dict(doc.get("flowControl") or {}))  # (refs are rewritten)
    detector = flow.pop("saturationDetector", None)  # (llm-d-router's place for it)
    epp = dict(doc)
    if detector is not None and not doc.get("saturationDetector"):
        epp["saturationDetector"] = detector
    try:
        saturation = SaturationDetectorConfig.from_epp(epp)
        if not doc.get("flowControl") or not enabled:
            if doc.get("flowControl"):
                log.warning("the flowControl section is not read: its feature gate "
                            "(featureGates: [flowControl]) is off")
            return saturation, None
        limit = plugins.get(flow.pop("usageLimitPolicyPluginRef", "") or "")
        if doc["flowControl"].get("usageLimitPolicyPluginRef") and limit is None:
            raise PluginError(f"flowControl.usageLimitPolicyPluginRef "
                              f"{doc['flowControl']['usageLimitPolicyPluginRef']!r}: no "
                              "such plugin")
        for band in (flow.get("defaultPriorityBand"), *(flow.get("priorityBands") or ())):
            if isinstance(band, dict):
                for key in _BAND_REFS:
                    if band.get(key):
                        band[key] = _type_of(band[key], plugins)
        cfg = FlowControlConfig.from_dict(flow)
        params = getattr(limit, "params", None)
        if getattr(limit, "type", None) == "static-usage-limit-policy":
            cfg = dataclasses.replace(cfg, usage_threshold=params.threshold)
        elif getattr(limit, "type", None) == "priority-holdback-policy":
            cfg = dataclasses.replace(cfg, holdback_min=params.min_ceiling,
                                      holdback_max=params.max_ceiling)
        elif limit is not None:
            raise PluginError(f"flowControl.usageLimitPolicyPluginRef: {limit.name!r} is "
                              "not a usage limit policy")
        return saturation, cfg
    except ValueError as err:
        raise PluginError(str(err)) from err


def _type_of(ref: str, plugins: Mapping[str, object]) -> str:
    p = plugins.get(ref)
    return getattr(p, "type", ref) if p is not None else ref
