"""EndpointPickerConfig (llm-d's and GIE's file) -> a routing plan: plugin instances,
scheduling profiles, a profile handler, and the flow-control sections.

    apiVersion: llm-d.ai/v1alpha1      # or inference.networking.x-k8s.io/v1alpha1, ...
    kind: EndpointPickerConfig
    featureGates: [flowControl]        # `name` or `name=true|false`
    plugins:                           # type, name (default: the type), parameters
    - type: prefix-cache-scorer
    - type: queue-scorer
    schedulingProfiles:                # name, plugins: pluginRef (+ weight, default 1)
    - name: default
      plugins: [{pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: queue-scorer}]
    saturationDetector: {pluginRef: utilization-detector}   # (`flow_sections.py`)
    flowControl: {...}
    dataLayer: {sources: [...]}        # references checked; the data layer is built in
    parser: {pluginRef: openai-parser}

As llm-d's loader does, a configuration
- without `schedulingProfiles` gets one profile `default` with every filter, scorer and
  picker;
- with one profile and no profile handler gets the single-profile-handler;
- gets the max-score-picker (or its one configured picker) in a profile without one;
- gets the approx-prefix-cache-producer when a plugin reads prefix hits and no
  producer predicts them.
Plugins may be listed in any order. An unknown type, parameter, section, field, gate or
reference is a `PluginError` that names it and lists the known ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from sluice.gateway.routing.flow_sections import flow_sections
from sluice.gateway.routing.plan import RoutingPlan
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import (
    Filter,
    Picker,
    ProfileHandler,
    Scorer,
)
from sluice.gateway.routing.profile import SchedulingProfile
from sluice.gateway.routing.registry import PluginError, build, check_keys

API_VERSIONS = ("llm-d.ai/v1alpha1", "llm-d.ai/v1",
                "inference.networking.x-k8s.io/v1alpha1",  # GIE's, and llm-d's older one
                "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1")
KIND = "EndpointPickerConfig"
SECTIONS = ("apiVersion", "kind", "plugins", "schedulingProfiles", "featureGates",
            "saturationDetector", "flowControl", "dataLayer", "data", "parser",
            "requestHandler")
# the feature gates llm-d and GIE have defined. flowControl turns the flowControl section
# on, as theirs; Sluice's data layer is built in, so the others change nothing
FEATURE_GATES = ("flowControl", "dataLayer", "enableLegacyMetrics", "prepareDataPlugins",
                 "haPopulateNonLeaderDatastore")


def shipped_names() -> list[str]:
    """The configurations shipped in `configs/` (`--routing NAME`)."""
    return sorted(p.name.removesuffix(".yaml") for p in _configs().iterdir()
                  if p.name.endswith(".yaml"))


def _configs():
    return resources.files("sluice.gateway.routing") / "configs"


def read_document(path: str | Path | None = None, shipped: str | None = None) -> dict:
    """The configuration of a file, or of a shipped name."""
    if shipped is not None:
        if shipped not in shipped_names():
            raise PluginError(f"no shipped routing configuration {shipped!r}; shipped: "
                              + ", ".join(shipped_names()))
        text = (_configs() / f"{shipped}.yaml").read_text()
    else:
        text = Path(path).read_text()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PluginError(f"the routing configuration is not YAML: {err}") from err
    if not isinstance(doc, dict):
        raise PluginError("the routing configuration must be a mapping")
    return doc


def set_parameters(doc: Mapping[str, Any], type_name: str, **params: Any) -> dict:
    """A copy of `doc` with `params` (camelCase names) set on every plugin of
    `type_name`; a PluginError when it has none."""
    doc = copy.deepcopy(dict(doc))
    specs = [p for p in _list(doc, "plugins")
             if isinstance(p, Mapping) and p.get("type") == type_name]
    if not specs:
        raise PluginError(f"the routing configuration has no {type_name}")
    for spec in specs:
        spec["parameters"] = {**(spec.get("parameters") or {}), **params}
    return doc


def load_plan(doc: Mapping[str, Any], name: str, ctx: PluginContext,
              default_block_size: int = 16) -> RoutingPlan:
    """Build the plan of an EndpointPickerConfig document (see the module docstring)."""
    check_keys("the configuration", doc, SECTIONS)
    if doc.get("kind") != KIND or doc.get("apiVersion") not in API_VERSIONS:
        raise PluginError(f"a routing configuration is kind {KIND} with apiVersion one of "
                          f"{', '.join(API_VERSIONS)}; got {doc.get('kind')!r} "
                          f"{doc.get('apiVersion')!r}")
    gates = _feature_gates(doc)
    plugins: dict[str, object] = {}
    for spec in _list(doc, "plugins"):
        check_keys("a plugin", spec, ("type", "name", "parameters"))
        if not isinstance(spec.get("type"), str):
            raise PluginError(f"a plugin needs a type: {spec!r}")
        pname = spec.get("name") or spec["type"]
        if pname in plugins:
            raise PluginError(f"two plugins are named {pname!r}")
        plugins[pname] = build(spec["type"], pname, spec.get("parameters"), ctx)
    _add_missing_producer(plugins, ctx)
    profiles = _profiles(doc, plugins, ctx)
    handlers = [p for p in plugins.values() if isinstance(p, ProfileHandler)]
    if len(handlers) > 1:
        raise PluginError("more than one profile handler: "
                          + ", ".join(h.name for h in handlers))
    if not handlers:
        if len(profiles) != 1:
            raise PluginError(f"{len(profiles)} scheduling profiles need a profile handler "
                              "(e.g. disagg-profile-handler)")
        handlers = [build("single-profile-handler", "single-profile-handler", None, ctx)]
        plugins[handlers[0].name] = handlers[0]
    handler = handlers[0]
    _resolve_decider(handler, plugins)
    handler.bind(list(profiles))
    _check_refs(doc, plugins)
    return RoutingPlan(name, plugins, profiles, handler, default_block_size, gates,
                       *flow_sections(doc, plugins, "flowControl" in gates))


def _feature_gates(doc: Mapping[str, Any]) -> frozenset[str]:
    """The gates turned on: `name` or `name=true` (false: off), as llm-d reads them."""
    on = set()
    for entry in _list(doc, "featureGates"):
        gate, _, value = str(entry).partition("=")
        if gate not in FEATURE_GATES:
            raise PluginError(f"unknown feature gate {gate!r}; known: "
                              + ", ".join(FEATURE_GATES))
        if value.lower() not in ("", "true", "false", "1", "0"):
            raise PluginError(f"feature gate {entry!r}: the value is true or false")
        if value.lower() in ("", "true", "1"):
            on.add(gate)
    return frozenset(on)


def _add_missing_producer(plugins: dict[str, object], ctx: PluginContext) -> None:
    """One prefix producer predicts every candidate's hits: the configured one, else
    the approximate one when some plugin reads hits (GIE creates missing producers)."""
    producers = [p.name for p in plugins.values() if getattr(p, "produces_prefix", False)]
    if len(producers) > 1:
        raise PluginError(f"{len(producers)} prefix producers ({', '.join(producers)}); "
                          "one predicts the hits every plugin reads")
    if not producers and any(getattr(p, "consumes_prefix", False) for p in plugins.values()):
        name = "approx-prefix-cache-producer"
        plugins[name] = build(name, name, None, ctx)


def _profiles(doc: Mapping[str, Any], plugins: dict[str, object],
              ctx: PluginContext) -> dict[str, SchedulingProfile]:
    specs = _list(doc, "schedulingProfiles")
    if not specs:
        specs = [{"name": "default", "plugins": [
            {"pluginRef": n} for n, p in plugins.items()
            if isinstance(p, (Filter, Scorer, Picker))]}]
    # a profile without a picker gets the configuration's picker, else max-score-picker
    default_picker = next((p for p in plugins.values() if isinstance(p, Picker)), None)
    profiles: dict[str, SchedulingProfile] = {}
    for spec in specs:
        check_keys("a scheduling profile", spec, ("name", "plugins"))
        pname = spec.get("name")
        if not isinstance(pname, str) or not pname or pname in profiles:
            raise PluginError(f"a scheduling profile needs a unique name: {pname!r}")
        prof = profiles[pname] = SchedulingProfile(pname)
        for ref in _list(spec, "plugins"):
            _add_ref(prof, ref, plugins)
        if prof.picker is None:
            if default_picker is None:
                default_picker = build("max-score-picker", "max-score-picker", None, ctx)
                plugins[default_picker.name] = default_picker
            prof.picker = default_picker
    return profiles


def _add_ref(prof: SchedulingProfile, ref: Any, plugins: dict[str, object]) -> None:
    check_keys(f"a plugin reference of profile {prof.name!r}", ref, ("pluginRef", "weight"))
    target = plugins.get(ref.get("pluginRef"))
    if target is None:
        raise PluginError(f"profile {prof.name!r} references {ref.get('pluginRef')!r}, "
                          f"which no plugin is named; plugins: {', '.join(plugins)}")
    weight = ref.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise PluginError(f"profile {prof.name!r}: weight of {target.name!r} must be a "
                          f"number >= 0, not {weight!r}")
    kinds = 0
    if isinstance(target, Filter):
        prof.filters.append(target)
        kinds += 1
    if isinstance(target, Scorer):
        prof.scorers.append((float(weight), target))
        kinds += 1
    if isinstance(target, Picker):
        if prof.picker is not None:
            raise PluginError(f"profile {prof.name!r} has two pickers")
        prof.picker = target
        kinds += 1
    if not kinds and not hasattr(target, "pre_request"):
        raise PluginError(f"profile {prof.name!r} references {target.name!r} "
                          f"({target.type}), which is not a filter, scorer or picker")


def _resolve_decider(handler: object, plugins: dict[str, object]) -> None:
    """A disaggregating handler names its decider plugin."""
    optional = getattr(handler, "optional_decider_ref", None)
    if optional is not None and hasattr(plugins.get(optional), "disaggregate"):
        handler.decider = plugins[optional]
    want = getattr(handler, "decider_ref", None)
    if want is not None:
        decider = plugins.get(want)
        if decider is None or not hasattr(decider, "disaggregate"):
            raise PluginError(f"{handler.name} names decider {want!r}, which is not a "
                              "configured decider plugin (prefix-based-pd-decider, "
                              "always-disagg-pd-decider)")
        handler.decider = decider


def _check_refs(doc: Mapping[str, Any], plugins: dict[str, object]) -> None:
    """The data layer's and the parser's references name configured plugins."""
    refs = []
    data = _mapping(doc, "dataLayer") or _mapping(doc, "data")
    for source in _list(data, "sources"):
        refs.append(source.get("pluginRef"))
        refs.extend(e.get("pluginRef") for e in _list(source, "extractors"))
    refs.append(_mapping(doc, "parser").get("pluginRef"))
    refs.extend(p.get("pluginRef") for p in _list(_mapping(doc, "requestHandler"), "parsers"))
    for ref in refs:
        if ref is not None and ref not in plugins:
            raise PluginError(f"{ref!r} is referenced but no plugin is named so; plugins: "
                              + ", ".join(plugins))


def _list(doc: Mapping[str, Any], key: str) -> list:
    value = doc.get(key) or []
    if not isinstance(value, list):
        raise PluginError(f"{key} must be a list")
    return value


def _mapping(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise PluginError(f"{key} must be a mapping")
    return value
