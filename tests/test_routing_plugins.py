"""Each routing plugin's policy, on candidates the test sets (no I/O)."""

import asyncio
import base64
import collections
import time

import pytest

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest
from sluice.gateway.routing.registry import build

CTX = PluginContext(PrefixIndex(LocalIndex(), None))
REQ = RoutingRequest("m", list(range(100)))


def make(type_name, **params):
    return build(type_name, type_name, params, CTX)


def cands(**fields):
    """One candidate per pod; fields: name -> list of values (one per pod)."""
    n = len(next(iter(fields.values())))
    return [Candidate(f"p{i}:1", **{k: v[i] for k, v in fields.items()}) for i in range(n)]


def result(c, cold=False):
    return ProfileResult((c,), (1.0,), cold)


def test_queue_scorer_is_min_max_over_the_waiting_queues():
    s = make("queue-scorer").score(REQ, cands(waiting=[2.0, 6.0, 4.0, None]))
    assert s == [1.0, pytest.approx(1 / 5), pytest.approx(3 / 5), 0.0]  # unknown: worst
    assert make("queue-scorer").score(REQ, cands(waiting=[3.0, 3.0])) == [1.0, 1.0]


def test_running_requests_and_kv_cache_utilization_scorers():
    assert make("running-requests-size-scorer").score(REQ, cands(running=[1.0, 3.0])) \
        == [1.0, 0.0]
    assert make("kv-cache-utilization-scorer").score(
        REQ, cands(kv_usage=[0.25, 1.0, None])) == [0.75, 0.0, 0.0]


def test_request_queue_scorer_counts_in_flight_before_the_scrape():
    c = cands(waiting=[0.0, 0.0], running=[1.0, 0.0], inflight=[0, 3])
    assert make("request-queue-scorer").score(REQ, c) == [pytest.approx(1 - 1 / 4), 0.25]


def test_load_aware_scorer_halves_and_caps_at_its_threshold():
    s = make("load-aware-scorer", threshold=10).score(REQ, cands(waiting=[0.0, 5.0, 30.0]))
    assert s == [0.5, 0.25, 0.0]


def test_active_request_and_token_load_scorers():
    s = make("active-request-scorer", idleThreshold=1, maxBusyScore=0.5).score(
        REQ, cands(inflight=[1, 2, 4]))
    assert s == [1.0, 0.25, 0.0]
    s = make("token-load-scorer", queueThresholdTokens=100).score(
        REQ, cands(pending_prefill=[0, 50, 400]))
    assert s == [1.0, 0.5, 0.0]


def test_lora_affinity_scorer_levels():
    req = RoutingRequest("ad")
    c = cands(running_loras=[frozenset({"ad"}), frozenset({"x"}), frozenset({"x", "y"}),
                             frozenset({"x", "y"})],
              waiting_loras=[frozenset(), frozenset(), frozenset({"ad"}), frozenset()],
              max_loras=[1, 2, 2, 2])
    assert make("lora-affinity-scorer").score(req, c) == [1.0, 0.8, 0.6, 0.0]


def test_prefix_cache_scorer_ratio_and_match_length():
    c = cands(hit_blocks=[5, 0], total_blocks=[10, 10], block_size=[16, 16])
    assert make("prefix-cache-scorer").score(REQ, c) == [0.5, 0.0]
    s = make("prefix-cache-scorer", matchLengthWeight=0.5, matchLengthScaleTokens=160)
    assert s.score(REQ, c) == [pytest.approx(0.5 * (80 / 160) ** 2 + 0.25), 0.0]


def test_approx_producer_predicts_what_it_sent_and_caps_the_match():
    p = make("approx-prefix-cache-producer", maxPrefixBlocksToMatch=4)
    req = RoutingRequest("m", list(range(165)))
    c = cands(block_size=[16, 16], prompt_tokens=[165, 165], key_group=[("m", 16)] * 2)
    asyncio.run(p.prepare(req, c))
    assert [x.hit_blocks for x in c] == [0, 0]
    p.pre_request(req, "default", result(c[1]))
    asyncio.run(p.prepare(RoutingRequest("m", list(range(165))), c))
    assert [x.hit_blocks for x in c] == [0, 4]


def test_precise_producer_reads_the_index_and_speculates_what_the_target_lacks():
    index = PrefixIndex(LocalIndex(), None)
    p = build("precise-prefix-cache-producer", "p", {"speculativeIndexing": True,
                                                     "speculativeTTL": "1500ms"},
              PluginContext(index))
    assert p.ttl_ms == 1500
    from sluice.gateway.prompt.block_keys import request_keys
    keys = request_keys("m", 16, list(range(165)))
    index.local.store("p0:1", [(f"h{i}", k) for i, k in enumerate(keys[:3])])
    req = RoutingRequest("m", list(range(165)))
    c = cands(block_size=[16, 16], prompt_tokens=[165, 165], key_group=[("m", 16)] * 2)
    asyncio.run(p.prepare(req, c))
    assert [x.hit_blocks for x in c] == [3, 0] and c[0].held_blocks == 3
    assert p.pre_request(req, "default", result(c[0])) == tuple(keys[3:])
    off = build("precise-prefix-cache-producer", "p", None, PluginContext(index))
    assert off.ttl_ms == 0 and off.pre_request(req, "default", result(c[0])) == ()


def test_max_score_picker_orders_by_score_and_spreads_cold_ties():
    picker = make("max-score-picker")
    c = cands(hit_blocks=[1, 0, 0])
    assert picker.pick(REQ, c, [0.2, 0.9, 0.5]) == [1, 2, 0]
    spread = make("max-score-picker", coldSpread=0.25)
    cold = cands(hit_blocks=[0, 0, 0])
    firsts = collections.Counter(spread.pick(REQ, cold, [1.0, 0.9, 0.5])[0]
                                 for _ in range(200))
    assert set(firsts) == {0, 1} and min(firsts.values()) > 50


def test_random_weighted_and_round_robin_pickers():
    c = cands(hit_blocks=[0, 0, 0])
    rnd = make("random-picker")
    seen = collections.Counter(rnd.pick(REQ, c, [1, 0, 0])[0] for _ in range(300))
    assert set(seen) == {0, 1, 2}
    w = make("weighted-random-picker")
    seen = collections.Counter(w.pick(REQ, c, [0.75, 0.25, 0.0])[0] for _ in range(2000))
    assert seen[2] == 0 and 0.65 < seen[0] / 2000 < 0.85
    rr = make("round-robin-picker")
    assert [rr.pick(REQ, c, [0, 0, 0])[0] for _ in range(4)] == [0, 1, 2, 0]


def test_soft_filters_drop_hot_or_full_pods_but_never_all():
    c = cands(kv_usage=[0.99, 0.5, None])
    assert [x.pod for x in make("kv-cache-ceiling-filter").filter(REQ, c)] == ["p1:1", "p2:1"]
    full = cands(kv_usage=[0.99, 0.97])
    assert make("kv-cache-ceiling-filter").filter(REQ, full) == full
    c = cands(waiting=[0.0, None])
    assert [x.pod for x in make("known-load-filter").filter(REQ, c)] == ["p0:1"]
    c = cands(waiting=[40.0, 2.0, 3.0], running=[8.0, 1.0, 1.0])
    assert [x.pod for x in make("load-imbalance-filter").filter(REQ, c)] == ["p1:1", "p2:1"]


def test_role_filters_are_hard():
    c = cands(role=["prefill", "decode", "both", None])
    assert [x.role for x in make("decode-filter").filter(REQ, c)] == ["decode", "both", None]
    assert [x.role for x in make("prefill-filter").filter(REQ, c)] == ["prefill"]
    assert make("prefill-filter").filter(REQ, cands(role=["decode"])) == []


def test_utilization_detector_filters_to_pods_with_room():
    now = time.time() * 1000
    c = cands(waiting=[6.0, 2.0, 1.0], kv_usage=[0.1, 0.5, 0.5],
              load_ts_ms=[now, now, now - 5000])  # the last one's load is stale
    assert [x.pod for x in make("utilization-detector").filter(REQ, c)] == ["p1:1"]


def test_session_affinity_by_encoded_token_and_by_session_id():
    enc = make("session-affinity-scorer")
    token = enc.response_headers("p1:1")["x-session-token"]
    assert base64.b64decode(token) == b"p1:1"
    c = cands(waiting=[0.0, 0.0, 0.0])
    assert enc.score(RoutingRequest("m", headers={"x-session-token": token}), c) \
        == [0.0, 1.0, 0.0]
    assert enc.score(RoutingRequest("m", headers={"x-session-token": "%%"}), c) == [0.0] * 3
    sid = make("session-affinity-scorer", strategy="session_id",
               sessionIdConfig={"sources": [{"header": "x-session-id"},
                                            {"attribute": "api_key"}]})
    req = RoutingRequest("m", headers={"x-session-id": "s1"}, primary="default")
    assert sid.score(req, c) == [0.0, 0.0, 0.0]
    sid.pre_request(req, "default", result(c[2]))
    assert sid.score(req, c) == [0.0, 0.0, 1.0]
    by_key = RoutingRequest("m", api_key="team-a", primary="default")
    sid.pre_request(by_key, "default", result(c[0]))
    assert sid.score(by_key, c) == [1.0, 0.0, 0.0] and sid.response_headers("p0:1") == {}


def test_no_hit_lru_spreads_cold_requests_over_the_least_recently_used():
    s = make("no-hit-lru-scorer")
    c = cands(hit_blocks=[0, 0, 0])
    firsts = []
    for _ in range(6):
        scores = s.score(REQ, c)
        best = c[max(range(3), key=lambda i: scores[i])]
        firsts.append(best.pod)
        s.pre_request(REQ, "default", result(best, cold=True))
    assert firsts == ["p0:1", "p1:1", "p2:1", "p0:1", "p1:1", "p2:1"]
    assert s.score(REQ, cands(hit_blocks=[1, 0])) == [0.5, 0.5]  # warm: no opinion


def test_deciders():
    req = RoutingRequest("m", list(range(100)))
    d = make("prefix-based-pd-decider", nonCachedTokens=40, promptTokens=120)
    assert not d.disaggregate(req, Candidate("a", prompt_tokens=100))  # prompt too short
    d = make("prefix-based-pd-decider", nonCachedTokens=40)
    hit = Candidate("a", prompt_tokens=100, block_size=16, hit_blocks=4)  # 36 left
    assert not d.disaggregate(req, hit)
    assert d.disaggregate(req, Candidate("a", prompt_tokens=100, hit_blocks=3))  # 52
    assert not make("prefix-based-pd-decider").disaggregate(req, Candidate("a", prompt_tokens=100))
    assert make("always-disagg-pd-decider").disaggregate(req, hit)


def test_probabilistic_admitter_sheds_by_saturation():
    a = make("probabilistic-admitter")
    idle = [{"waiting": 0.0, "kv_usage": 0.04}] * 3
    assert a.saturation(idle) == pytest.approx(0.05)
    assert all(a.admit_sheddable(idle) for _ in range(100))  # 0.05^5 x 300 ~ 0.01 %
    full = [{"waiting": 5.0, "kv_usage": 0.1}, None]
    assert not any(a.admit_sheddable(full) for _ in range(20))


def test_the_latency_recorder_times_a_streamed_answer_by_pod_and_prompt_class():
    from prometheus_client import CollectorRegistry

    from sluice.gateway.server.streamed import AnswerTiming

    registry = CollectorRegistry()
    rec = build("latency-recorder", "latency-recorder", None, PluginContext(metrics=registry))
    t = AnswerTiming(time.perf_counter() - 0.2)  # decided 200 ms ago
    assert not t.ended(b'data: {"a": 1}\n\n', False)
    time.sleep(0.03)
    assert t.ended(b'data: {"a": 2}\n\ndata: {"a": 3}\n\ndata: [DONE]\n\n', True)
    served = t.served("p0:1", 300)
    assert served.ttft_s >= 0.2 and served.tpot_s >= 0.015 and served.output_tokens == 3
    rec.post_response(REQ, served)
    labels = {"pod": "p0:1", "prompt_tokens": "512"}
    assert registry.get_sample_value("sluice_gateway_request_ttft_seconds_count", labels) == 1
    assert registry.get_sample_value("sluice_gateway_request_tpot_seconds_count", labels) == 1
    rec.forget_pod("p0:1")
    assert registry.get_sample_value("sluice_gateway_request_ttft_seconds_count", labels) is None


def test_session_affinity_refuses_what_it_does_not_know():
    from sluice.gateway.routing.registry import PluginError

    for params, match in (({"sessionIdConfig": {"evictionTTL": 5}}, "evictionTTL"),
                          ({"sessionIdConfig": {"evictionTtlSeconds": "5m"}}, "> 0"),
                          ({"sessionIdConfig": {"sources": [{"cookie": "s"}]}}, "source"),
                          ({"strategy": "sticky"}, "strategy")):
        with pytest.raises(PluginError, match=match):
            make("session-affinity-scorer", **params)
