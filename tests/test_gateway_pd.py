"""Disaggregated prefill/decode in the picker (routing/profiles/pd.py, the shipped
configurations' pd-profile-handler): roles from discovery, the
decode pod chosen among decode-capable pods, and the prefill decision's threshold on
the prompt's part the decode pod has not cached. On the local index (no I/O)."""

import asyncio
import dataclasses
import time

import pytest
from routing_testing import Pods, ScriptedRouter, shipped

from sluice import labels
from sluice.gateway.discovery.kubernetes import pod_endpoint
from sluice.gateway.discovery.static import parse_engine_spec, parse_role
from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import EngineMetrics, LoadTable
from sluice.gateway.prompt.block_keys import request_keys
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.profiles import pd

ROLES = {"d0:1": "decode", "d1:1": "both", "d2:1": None, "p0:1": "prefill", "p1:1": "prefill"}
PODS = list(ROLES)
LONG = list(range(1000, 1165))   # 165 tokens: 10 full blocks of 16 and 5
SHORT = list(range(1000, 1040))  # 40 tokens


def make(strategy="kv_aware", loads=None, unhealthy=(), threshold=None):
    index = PrefixIndex(LocalIndex(), None)
    table = LoadTable(ttl_ms=10_000)
    now = time.time() * 1000
    for pod in PODS:
        w, r, kv = (loads or {}).get(pod, (0, 0, 0.1))
        table.put(pod, EngineMetrics(waiting=w, running=r, kv_usage=kv), now)
    return ScriptedRouter(shipped(strategy, pd_threshold=threshold), index, table,
                      Pods(unhealthy, roles=ROLES)), index


def hold(index, pod, n_blocks, tokens=LONG):
    keys = request_keys("m", 16, tokens)[:n_blocks]
    index.local.store(pod, [(f"{pod}-{i}", k) for i, k in enumerate(keys)])


def route(router, tokens=LONG, pods=PODS):
    return asyncio.run(router.schedule("m", tokens, pods))


@pytest.mark.parametrize("strategy", ["round_robin", "least_load", "kv_aware"])
def test_prefill_pods_are_never_the_destination_nor_a_fallback(strategy):
    router, index = make(strategy, loads={"d0:1": (30, 8, 0.9), "d1:1": (20, 8, 0.9),
                                          "d2:1": (25, 8, 0.9)})  # prefill pods idle
    hold(index, "p0:1", 10)  # and holding the whole prompt
    for i in range(12):  # new prompts (kv_aware remembers where each one went)
        r = route(router, [t + 10_000 * i for t in LONG])
        assert {r.decode.pod, *r.decode.fallbacks} == {"d0:1", "d1:1", "d2:1"}
        assert r.outcome == pd.PREFILLED and r.prefill.pod in ("p0:1", "p1:1")
        assert r.prefill.fallbacks == ()  # tried once: the decode engine falls back itself


def test_a_long_uncached_prompt_gets_the_prefill_pod_with_its_prefix():
    router, index = make()
    hold(index, "p1:1", 6)
    hold(index, "d2:1", 2)  # the decode pod chosen still lacks 165 - 32 >= 100 tokens
    r = route(router)
    assert (r.decode.pod, r.decode.hit_blocks, r.decode.prefill_tokens) == ("d2:1", 2, 133)
    assert r.outcome == pd.PREFILLED
    assert (r.prefill.pod, r.prefill.hit_blocks) == ("p1:1", 6)


def test_the_prefill_pod_is_chosen_by_load_too():
    router, index = make(loads={"p1:1": (40, 8, 0.5)})  # p1 is hot: the gate drops it
    hold(index, "p1:1", 4)
    assert route(router).prefill.pod == "p0:1"


def test_short_or_mostly_cached_prompts_skip_the_prefill_pod():
    router, index = make()
    r = route(router, SHORT)
    assert r.outcome == pd.SHORT and r.prefill is None and r.decode.prefill_tokens == 40
    hold(index, "d1:1", 10)  # 160 of 165 tokens cached there: 5 left to compute
    r = route(router)
    assert (r.decode.pod, r.outcome, r.prefill) == ("d1:1", pd.SHORT, None)


def test_the_threshold_is_inclusive_and_zero_never_disaggregates():
    assert route(make(threshold=40)[0], SHORT).outcome == pd.PREFILLED
    assert route(make(threshold=41)[0], SHORT).outcome == pd.SHORT
    assert route(make(threshold=0)[0], LONG).outcome == pd.SHORT
    decider = make()[0].plan.handler.decider
    target = Candidate("d0:1", prompt_tokens=165)
    assert [decider.disaggregate(RoutingRequest("m", LONG), dataclasses.replace(
        target, hit_blocks=h)) for h in (5, 4)] == [False, True]  # 85 / 101 tokens to do


def test_no_healthy_prefill_pod_means_the_decode_pod_prefills():
    router, _ = make(unhealthy=("p0:1", "p1:1"))
    r = route(router)
    assert r.outcome == pd.NO_PREFILL_POD and r.prefill is None
    assert r.decode.pod in ("d0:1", "d1:1", "d2:1")


def test_a_pool_of_prefill_pods_only_has_no_destination():
    router, _ = make()
    assert route(router, pods=["p0:1", "p1:1"]) is None
    router, _ = make(unhealthy=("d0:1", "d1:1", "d2:1"))
    assert route(router) is None


def test_without_prefill_pods_routing_is_unchanged():
    """Decode / both / no role only: one plain route over all of them, no threshold."""
    decode_only = ["d0:1", "d1:1", "d2:1"]
    for strategy in ("round_robin", "kv_aware"):
        (a, ia), (b, ib) = make(strategy), make(strategy)
        for index in (ia, ib):
            hold(index, "d1:1", 3)
        for _ in range(5):
            r = route(a, pods=decode_only)
            plain = asyncio.run(b.route("m", LONG, decode_only))
            assert r.outcome == pd.NO_ROLES and r.prefill is None and r.decode == plain


def test_roles_from_labels_and_static_specs():
    assert [parse_role(v) for v in ("prefill", "decode", "both", "serve", "Decode", "x", None)] \
        == ["prefill", "decode", "both", "both", "decode", None, None]
    ep = parse_engine_spec("10.0.0.5:8000,model=m,role=prefill")
    assert (ep.pod, ep.role) == ("10.0.0.5:8000", "prefill")
    assert parse_engine_spec("10.0.0.6:8000").role is None
    with pytest.raises(ValueError, match="role="):
        parse_engine_spec("10.0.0.7:8000,role=serve")

    def pod(pod_labels):
        return {"metadata": {"name": "e", "namespace": "ns", "labels": pod_labels},
                "status": {"podIP": "10.1.0.2",
                           "conditions": [{"type": "Ready", "status": "True"}]},
                "spec": {"containers": []}}

    base = {labels.NAME: labels.ENGINE_NAME, labels.POOL: "p"}
    assert pod_endpoint(pod({**base, labels.ROLE: "prefill"}), "ns").role == "prefill"
    assert pod_endpoint(pod({**base, labels.ROLE: "serve"}), "ns").role == "both"
    assert pod_endpoint(pod({**base, labels.LLMD_ROLE: "decode"}), "ns").role == "decode"
    assert pod_endpoint(pod({**base, labels.ROLE: "decode", labels.LLMD_ROLE: "prefill"}),
                        "ns").role == "decode"  # ours first
    assert pod_endpoint(pod(base), "ns").role is None
    # the operator's own rendering of a prefill/decode pool's pods
    for role in ("prefill", "decode"):
        rendered = pod(labels.pod_labels("p", role))
        assert pod_endpoint(rendered, "ns").role == role
