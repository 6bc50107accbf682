"""EndpointPickerConfig files: llm-d's and GIE's published samples (tests/data/epp_configs,
each naming its source) load unchanged and route as their docs say; what Sluice does not
serve is refused at start-up by name; mistakes are errors that list what is known."""

import asyncio
import time
from pathlib import Path

import pytest
import yaml
from routing_testing import Pods, ScriptedRouter, shipped

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import EngineMetrics, LoadTable
from sluice.gateway.routing.config import load_plan, read_document, set_parameters, shipped_names
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.profiles import pd
from sluice.gateway.routing.registry import PluginError

SAMPLES = Path(__file__).parent / "data" / "epp_configs"
PODS = ["a:1", "b:1", "c:1"]
LONG = list(range(1000, 1165))  # 165 tokens: 10 full blocks of 16
# samples that name what Sluice does not serve: refused by name, never half-loaded
REFUSED = {
    "gie-apix-request-attribute-reporter.yaml": "request-attribute-reporter",
    "gie-vllmgrpc-parser.yaml": "vllmgrpc-parser",  # gRPC model servers
    "llmd-data-parallel.yaml": "data-parallel-profile-handler",
    "llmd-e-pd.yaml": "encode-filter",  # encode stages
    "llmd-epd.yaml": "encode-filter",
    "llmd-flow-control-program-aware.yaml": "program-aware-fairness",
    "llmd-flow-control-soft-reflective-ceiling.yaml": "soft-reflective-ceiling-policy",
    "llmd-guide-flow-control-priority-bands.yaml": "enableEviction",  # in-flight eviction
}


def sample(name):
    return yaml.safe_load((SAMPLES / name).read_text())


def router(doc, loads=None, roles=None):
    index = PrefixIndex(LocalIndex(), None)
    table = LoadTable(ttl_ms=10_000)
    now = time.time() * 1000
    for pod in PODS + list(roles or {}):
        w, r, kv = (loads or {}).get(pod, (0, 0, 0.1))
        table.put(pod, EngineMetrics(waiting=w, running=r, kv_usage=kv), now)
    return ScriptedRouter(doc, index, table, Pods(roles=roles or {}))


def route(r, tokens=LONG, pods=PODS):
    return asyncio.run(r.schedule("m", tokens, pods))


@pytest.mark.parametrize("name", sorted(p.name for p in SAMPLES.glob("*.yaml")))
def test_every_sample_loads_or_is_refused_naming_what_is_missing(name):
    ctx = PluginContext(PrefixIndex(LocalIndex(), None))
    if name in REFUSED:
        with pytest.raises(PluginError, match=REFUSED[name]):
            load_plan(sample(name), name, ctx)
    else:
        plan = load_plan(sample(name), name, ctx)
        assert plan.profiles and all(p.picker is not None for p in plan.profiles.values())


def test_every_sample_names_its_source():
    for path in SAMPLES.glob("*.yaml"):
        assert path.read_text().startswith("# Source: https://github.com/"), path.name


def test_llmd_prefix_cache_aware_sends_a_prefix_back_where_it_went():
    r = router(sample("llmd-prefix-cache-aware.yaml"), loads={"a:1": (9, 9, 0.9)})
    first = route(r).decode
    again = [route(r).decode for _ in range(5)]
    assert {d.pod for d in again} == {first.pod} and again[0].hit_blocks == 10
    assert route(r, [t + 50_000 for t in LONG]).decode.hit_blocks == 0  # another prompt


def test_gie_inference_scheduling_weights_route_a_cold_prompt_by_load():
    """queue 2, kv-cache 2, prefix 3 (llm-d's inference-scheduling guide)."""
    doc = sample("llmd-guide-inference-scheduling.yaml")
    r = router(doc, loads={"a:1": (6, 4, 0.7), "b:1": (0, 2, 0.2), "c:1": (3, 3, 0.5)})
    assert route(r).decode.pod == "b:1"
    # the prompt is now cached on b:1 (history): it stays there though b:1 got busier
    r.scheduler.loads.put("b:1", EngineMetrics(waiting=2, running=3, kv_usage=0.4),
                          time.time() * 1000)
    assert route(r).decode.pod == "b:1"


def test_a_configuration_of_the_queue_scorer_alone_routes_on_load_alone():
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": [{"type": "queue-scorer"}]}
    r = router(doc, loads={"a:1": (5, 0, 0.0), "b:1": (1, 9, 0.99), "c:1": (3, 0, 0.0)})
    plan = r.plan
    assert not plan.uses_prompt and not plan.uses_events
    assert [c.pod for c in [route(r).decode]] == ["b:1"]  # least waiting, whatever else
    assert route(r).decode.fallbacks == ("c:1", "a:1")


def test_llmd_load_aware_prefers_an_empty_queue():
    r = router(sample("llmd-load-aware-estimate-prefix.yaml"),
               loads={"a:1": (4, 0, 0.1), "b:1": (0, 8, 0.9), "c:1": (64, 0, 0.1)})
    assert route(r).decode.pod == "b:1"


def test_llmd_pd_disaggregates_uncached_prompts_and_not_cached_ones():
    roles = {"d0:1": "decode", "d1:1": "decode", "p0:1": "prefill"}
    r = router(sample("llmd-pd.yaml"), roles=roles)
    pods = list(roles)
    first = route(r, pods=pods)  # 165 uncached tokens >= nonCachedTokens 16
    assert first.outcome == pd.PREFILLED and first.prefill.pod == "p0:1"
    assert first.decode.pod in ("d0:1", "d1:1")
    again = route(r, pods=pods)  # the decode pod holds all but the last block now
    assert (again.decode.pod, again.outcome) == (first.decode.pod, pd.SHORT)
    short = route(r, list(range(5000, 5010)), pods)  # 10 tokens
    assert short.outcome == pd.SHORT and short.prefill is None


def test_llmd_v03_pd_profile_handler_always_disaggregates():
    """llm-d 0.3's pd-profile-handler without a threshold: always P/D (its default 0)."""
    roles = {"d0:1": "decode", "p0:1": "prefill"}
    for name in ("llmd-scheduler-v0.3-pd-profile-handler.yaml",
                 "llmd-guide-pd-profile-handler-threshold.yaml"):
        r = router(sample(name), roles=roles)
        got = route(r, list(range(10)), list(roles))
        assert (got.decode.pod, got.prefill.pod, got.outcome) == ("d0:1", "p0:1",
                                                                 pd.PREFILLED), name


def test_the_shipped_configurations_load_and_are_named():
    assert shipped_names() == ["kv_aware", "least_load", "prefix", "round_robin"]
    ctx = PluginContext(PrefixIndex(LocalIndex(), None))
    uses = {n: load_plan(shipped(n), n, ctx) for n in shipped_names()}
    assert [n for n, p in uses.items() if p.uses_events] == ["kv_aware"]
    assert sorted(n for n, p in uses.items() if p.uses_prompt) == ["kv_aware", "prefix"]


def bad(doc_patch, match):
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": [{"type": "queue-scorer"}], **doc_patch}
    with pytest.raises(PluginError, match=match):
        load_plan(doc, "bad", PluginContext(PrefixIndex(LocalIndex(), None)))


def test_mistakes_are_errors_that_name_them_and_list_what_is_known():
    bad({"plugins": [{"type": "qeue-scorer"}]},
        r"unknown plugin type 'qeue-scorer'; known types: .*queue-scorer")
    bad({"plugins": [{"type": "load-aware-scorer", "parameters": {"treshold": 3}}]},
        r"no parameter 'treshold'; known: threshold")
    bad({"plugins": [{"type": "load-aware-scorer", "parameters": {"threshold": "3"}}]},
        r"parameter 'threshold' must be int")
    bad({"plugins": [{"type": "max-score-picker", "parameters": {"coldSpread": -1}}]},
        "bad parameters")
    bad({"schedulingProfile": []}, r"unknown field\(s\) 'schedulingProfile'")
    bad({"featureGates": ["flowKontrol"]}, "unknown feature gate 'flowKontrol'")
    bad({"apiVersion": "v1"}, "apiVersion one of llm-d.ai/v1alpha1")
    bad({"schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "nope"}]}]},
        "references 'nope', which no plugin is named")
    bad({"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}]},
        "two plugins are named 'queue-scorer'")
    bad({"schedulingProfiles": [{"name": "a", "plugins": []}, {"name": "b", "plugins": []}]},
        "2 scheduling profiles need a profile handler")
    bad({"plugins": [{"type": "disagg-profile-handler",
                      "parameters": {"deciders": {"prefill": "d"}}}],
         "schedulingProfiles": [{"name": "decode"}, {"name": "prefill"}]},
        "names decider 'd', which is not a configured decider")
    bad({"plugins": [{"type": "approx-prefix-cache-producer"},
                     {"type": "precise-prefix-cache-producer"}]}, "2 prefix producers")
    bad({"dataLayer": {"sources": [{"pluginRef": "metrics-data-source"}]}},
        "'metrics-data-source' is referenced but no plugin is named so")


def test_feature_gates_turn_flow_control_on_as_llmd_reads_them():
    base = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
            "plugins": [{"type": "queue-scorer"}],
            "flowControl": {"defaultRequestTTL": "30s",
                            "priorityBands": [{"priority": 10, "maxRequests": 50}]}}
    ctx = PluginContext(PrefixIndex(LocalIndex(), None))
    assert load_plan(base, "x", ctx).flow_control is None  # gate off: not read
    for gates in (["flowControl"], ["flowControl=true"]):
        flow = load_plan({**base, "featureGates": gates}, "x", ctx).flow_control
        assert flow.default_request_ttl_s == 30 and flow.band(10).max_requests == 50
    assert load_plan({**base, "featureGates": ["flowControl=false"]}, "x",
                     ctx).flow_control is None


def test_set_parameters_copies_and_refuses_a_missing_type():
    doc = read_document(shipped="kv_aware")
    changed = set_parameters(doc, "prefix-based-pd-decider", nonCachedTokens=7)
    assert changed != doc and read_document(shipped="kv_aware") == doc
    with pytest.raises(PluginError, match="has no round-robin-picker"):
        set_parameters(doc, "round-robin-picker", x=1)
