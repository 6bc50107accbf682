"""An EndpointPickerConfig's `saturationDetector` and `flowControl` sections, read with
the plugins they name (`flow_policies.py`) into `flow`'s configurations."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sluice.gateway.flow.config import FlowControlConfig
from sluice.gateway.flow.saturation import SaturationDetectorConfig
from sluice.gateway.routing.registry import PluginError

log = logging.getLogger("sluice.gateway.routing")

_BAND_REFS = ("fairnessPolicyRef", "orderingPolicyRef")


def flow_sections(doc: Mapping[str, Any], plugins: Mapping[str, object], enabled: bool
                  ) -> tuple[SaturationDetectorConfig, FlowControlConfig | None]:
    """(The saturation detector's configuration; flow control's, or None when the
    `flowControl` feature gate is off, as llm-d and GIE leave the section unread then).
    A plugin reference names a configured plugin, or a type by its default name."""
    flow = dict(doc.get("flowControl") or {})
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
        limit = flow.get("usageLimitPolicyPluginRef")
        if limit and _type_of(limit, plugins) == "static-usage-limit-policy":
            del flow["usageLimitPolicyPluginRef"]  # (threshold 1: what Sluice does)
        for band in (flow.get("defaultPriorityBand"), *(flow.get("priorityBands") or ())):
            if isinstance(band, dict):
                for key in _BAND_REFS:
                    if band.get(key):
                        band[key] = _type_of(band[key], plugins)
        return saturation, FlowControlConfig.from_dict(flow)
    except ValueError as err:
        raise PluginError(str(err)) from err


def _type_of(ref: str, plugins: Mapping[str, object]) -> str:
    p = plugins.get(ref)
    return getattr(p, "type", ref) if p is not None else ref
