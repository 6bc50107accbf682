"""Routing policy: filters -> scorers -> picker, on the local index (no I/O)."""

import asyncio
import collections
import time

from routing_testing import Pods, make_router

from sluice.gateway.index.local_index import LocalIndex
from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import EngineMetrics, LoadTable
from sluice.gateway.prompt.block_keys import request_keys
from sluice.gateway.routing.plugins import RoutingRequest

PODS = ["p0:1", "p1:1", "p2:1", "p3:1"]
PROMPT = list(range(1000, 1165))  # 10 full blocks of 16 and 5 tokens


def make(strategy="kv_aware", loads=None, unhealthy=(), inflight=None, pending=None,
         num_blocks=None, block_sizes=None, speculative_ttl_ms=None):
    index = PrefixIndex(LocalIndex(), None)
    table = LoadTable(ttl_ms=10_000)
    now = time.time() * 1000
    for pod in PODS:
        w, r, kv = (loads or {}).get(pod, (0, 0, 0.1))
        if w is not None:
            table.put(pod, EngineMetrics(waiting=w, running=r, kv_usage=kv,
                                         num_gpu_blocks=num_blocks), now)
    router = make_router(strategy, index, table,
                         Pods(unhealthy, inflight or {}, pending or {}, block_sizes or {}),
                         speculative_ttl_ms)
    return router, index


def hold(index, pod, n_blocks, tokens=PROMPT):
    keys = request_keys("m", 16, tokens)[:n_blocks]
    index.local.store(pod, [(f"{pod}-{i}", k) for i, k in enumerate(keys)])


def route(router, tokens=PROMPT, exclude=frozenset()):
    return asyncio.run(router.route("m", tokens, PODS, exclude))


def test_equal_load_longest_prefix_wins():
    router, index = make()
    hold(index, "p1:1", 3)
    hold(index, "p2:1", 7)
    hold(index, "p3:1", 5)
    d = route(router)
    assert (d.pod, d.hit_blocks, d.total_blocks) == ("p2:1", 7, 10)


def test_hot_pod_is_avoided_despite_its_prefix():
    router, index = make(loads={"p2:1": (40, 8, 0.5)})
    hold(index, "p1:1", 4)
    hold(index, "p2:1", 10)
    d = route(router)
    assert d.pod == "p1:1" and d.hit_blocks == 4  # gate dropped p2; next best prefix


def test_moderate_load_difference_keeps_affinity():
    router, index = make(loads={"p2:1": (3, 4, 0.3)})
    hold(index, "p2:1", 10)
    assert route(router).pod == "p2:1"


def test_kv_ceiling_and_unknown_load():
    router, index = make(loads={"p2:1": (0, 1, 0.99), "p0:1": (None, None, None)})
    hold(index, "p2:1", 10)
    d = route(router)
    assert d.pod not in ("p2:1", "p0:1")  # full KV cache; unknown load not preferred


def test_unknown_load_loses_even_with_the_whole_prefix():
    router, index = make(loads={"p0:1": (None, None, None)}, inflight={"p0:1": 5})
    hold(index, "p0:1", 10)
    hold(index, "p1:1", 1)
    d = route(router)
    assert (d.pod, d.hit_blocks) == ("p1:1", 1)
    router, index = make(loads={p: (None, None, None) for p in PODS})  # none known
    hold(index, "p0:1", 10)
    assert route(router).pod == "p0:1"


def test_cold_requests_spread():
    router, _ = make(strategy="kv_aware", speculative_ttl_ms=0)
    seen = collections.Counter()
    for i in range(200):
        seen[route(router, tokens=[i] * 64).pod] += 1
    assert set(seen) == set(PODS) and min(seen.values()) > 20


def test_new_prefixes_go_where_the_cache_has_room():
    # p0 and p1 each keep other prefixes filling 40 % of their caches, p2 20 %
    router, index = make(num_blocks=100, speculative_ttl_ms=0)
    for k, (pod, n) in enumerate((("p0:1", 40), ("p1:1", 40), ("p2:1", 20))):
        hold(index, pod, n, tokens=[500 + k] * 16 * n)
    assert {route(router, tokens=[i] * 64).pod for i in range(20)} == {"p3:1"}
    hold(index, "p3:1", 40, tokens=[600] * 16 * 40)
    assert {route(router, tokens=[i] * 64).pod for i in range(20)} == {"p2:1"}
    # a prefix hit still wins over room: p0 holds this prompt, p3 has more room
    hold(index, "p0:1", 10)
    assert route(router).pod == "p0:1"


def test_cold_request_avoids_pods_busy_with_prefills():
    router, _ = make(pending={"p0:1": 640, "p1:1": 480, "p2:1": 800}, speculative_ttl_ms=0)
    assert {route(router, tokens=[i] * 64).pod for i in range(20)} == {"p3:1"}


def test_prefix_hit_still_wins_over_a_small_pending_prefill():
    router, index = make(pending={"p2:1": 64})  # tokens
    hold(index, "p2:1", 10)
    assert route(router).pod == "p2:1"


def test_inflight_counts_before_scrape_catches_up():
    router, _ = make(strategy="least_load", inflight={"p0:1": 5, "p1:1": 5, "p2:1": 5})
    assert route(router).pod == "p3:1"


def test_unhealthy_and_excluded_pods_are_skipped():
    router, index = make(unhealthy=("p2:1",))
    hold(index, "p2:1", 10)
    hold(index, "p1:1", 2)
    assert route(router, exclude=frozenset({"p1:1"})).pod in ("p0:1", "p3:1")
    router2, _ = make(unhealthy=tuple(PODS))
    assert route(router2) is None


def test_round_robin_rotates():
    router, _ = make(strategy="round_robin")
    assert [route(router).pod for _ in range(8)] == PODS * 2


def test_speculative_entry_makes_a_burst_stick():
    router, _ = make(strategy="kv_aware")
    first = route(router)
    assert first.hit_blocks == 0
    again = [route(router) for _ in range(5)]
    assert {d.pod for d in again} == {first.pod} and again[0].hit_blocks == 10


def test_prefix_strategy_uses_routing_history_only():
    router, index = make(strategy="prefix")
    hold(index, "p3:1", 10)  # events are ignored by the approximate strategy
    first = route(router)
    assert first.hit_blocks == 0
    second = route(router)
    assert second.pod == first.pod and second.hit_blocks == 10


def test_a_pods_load_is_the_newer_of_its_scrape_and_redis_entry_until_it_expires():
    table = LoadTable(ttl_ms=1000)
    assert table.row("a:1", 5_000) is None
    table.put("a:1", EngineMetrics(waiting=1, running=2, kv_usage=0.5), 4_000)
    own = {"waiting": 1, "running": 2, "kv_usage": 0.5, "ts_ms": 4_000}
    assert table.row("a:1", 4_500) == own
    shared = {"waiting": 7, "running": 0, "kv_usage": 0.9, "ts_ms": 4_200}
    table.put_shared("a:1", shared)
    assert table.row("a:1", 4_500) == shared  # another replica scraped later
    table.put_shared("a:1", {**shared, "ts_ms": 4_000})
    assert table.row("a:1", 4_500) == own  # a tie: this replica's own
    assert table.row("a:1", 5_000) is None  # older than the TTL: unknown
    assert table.fresh(4_500) == {"a:1": own} and table.fresh(5_000) == {}


def test_parse_engine_metrics():
    from sluice.metrics_text import parse_engine_metrics
    text = """# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_running{model_name="m"} 2.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",model_name="m",num_gpu_blocks="4096"} 1.0
vllm:prefix_cache_hits_total{model_name="m"} 320.0
vllm:prefix_cache_queries_total{model_name="m"} 640.0
vllm:prefix_cache_hits_created{model_name="m"} 1.7e9
"""
    m = parse_engine_metrics(text)
    assert (m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks) == (3, 2, 0.25, 16,
                                                                                  4096)
    assert (m.prefix_hits, m.prefix_queries) == (320, 640)


def test_kv_usage_of_a_data_parallel_server_is_the_mean_of_its_engines():
    from sluice.metrics_text import parse_engine_metrics
    text = """vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
"""
    m = parse_engine_metrics(text)
    assert m.waiting == 4 and abs(m.kv_usage - 0.4) < 1e-9


def test_a_removed_pods_metric_series_go():
    from prometheus_client import generate_latest

    from sluice.gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.decided("kv_aware", "a:1", 2, 4)
    m.decided("round_robin", "b:1", 0, 0)
    m.forget_pod("a:1")
    m.forget_pod("never-seen:1")
    text = generate_latest(m.registry).decode()
    assert "a:1" not in text and 'pod="b:1"' in text
    m.decided("kv_aware", "a:1", 2, 4)  # back: a new series, not the dropped one's child
    text = generate_latest(m.registry).decode()
    assert ('sluice_gateway_routing_decisions_total{pod="a:1",strategy="kv_aware"} 1.0'
            in text)


def test_own_speculative_entries_extend_hits_found_elsewhere():
    """Against its definition: a pod's run goes on while each next key is within
    the other source's hits or an unexpired speculative entry of that pod."""
    import random
    rng = random.Random(0)
    keys = [f"k{i}" for i in range(12)]
    for _ in range(300):
        view, spec = LocalIndex(), {}
        for _ in range(rng.randrange(6)):
            pod, lo = rng.choice(PODS), rng.randrange(12)
            part, expiry = keys[lo:lo + rng.randrange(1, 6)], rng.choice([50.0, 100.0, 150.0])
            view.add_speculative(pod, part, expiry)
            spec.update({(pod, k): expiry for k in part})
        base = {p: rng.randrange(1, 4) for p in PODS if rng.random() < 0.5}
        expected = {}
        for p in PODS:
            n = 0
            while n < len(keys) and (n < base.get(p, 0) or spec.get((p, keys[n]), 0) > 100):
                n += 1
            if n:
                expected[p] = n
        assert view.with_speculative(keys, base, PODS, now_ms=100.0) == expected


def test_a_block_aligned_prompt_reuses_one_block_less_than_held():
    """As the engine: the last token is always computed, so a prompt of n full
    blocks reuses at most n - 1 of them."""
    router, index = make(loads={"p1:1": (10, 0, 0.1)})
    hold(index, "p1:1", 4, tokens=PROMPT[:64])
    d = route(router, tokens=PROMPT[:64])
    assert (d.pod, d.hit_blocks, d.total_blocks, d.prefill_tokens) == ("p1:1", 3, 4, 16)
    hold(index, "p1:1", 1, tokens=PROMPT[:16])  # one block: nothing to reuse, so the
    d = route(router, tokens=PROMPT[:16])       # queue at p1 decides
    assert d.pod != "p1:1" and d.hit_blocks == 0


def test_pods_with_other_block_sizes_compare_prefill_in_tokens():
    router, _ = make(block_sizes={"p0:1": 32}, speculative_ttl_ms=0)
    seen = collections.Counter(route(router, tokens=[i] * 320).pod for i in range(200))
    assert set(seen) == set(PODS) and min(seen.values()) > 20


def test_the_block_size_of_a_pods_events_is_used_before_any_scrape():
    from sluice.gateway.core import CoreConfig, RoutingCore
    from sluice.gateway.discovery.static import Endpoint, StaticDiscovery

    eps = [Endpoint(pod=p, url=f"http://{p}", model="m", pool="m") for p in PODS]
    gw = RoutingCore(CoreConfig(routing="kv_aware"), StaticDiscovery(eps))
    keys = request_keys("m", 32, PROMPT)
    gw.index.apply("p2:1", 0, [(f"h{i}", k) for i, k in enumerate(keys)], [], False, 32)
    d = asyncio.run(gw.scheduler.schedule(RoutingRequest("m", PROMPT), PODS)).decode
    assert (d.pod, d.hit_blocks, d.total_blocks) == ("p2:1", 5, 5)


def test_a_salted_request_never_counts_blocks_cached_under_another_salt():
    router, index = make(loads={"p1:1": (10, 0, 0.1)})
    hold(index, "p1:1", 10)  # this prompt, unsalted (events carry no salt)
    assert route(router).pod == "p1:1"
    first = asyncio.run(router.route("m", PROMPT, PODS, cache_salt="tenant-b"))
    assert first.pod != "p1:1" and first.hit_blocks == 0
    again = asyncio.run(router.route("m", PROMPT, PODS, cache_salt="tenant-b"))
    assert (again.pod, again.hit_blocks) == (first.pod, 10)  # its own decisions stick


def test_a_request_naming_an_alias_finds_blocks_keyed_by_the_pods_first_name():
    index = PrefixIndex(LocalIndex(), None)
    table = LoadTable(ttl_ms=10_000)
    # each pod serves "m" and "alias"
    router = make_router("kv_aware", index, table,
                         Pods(key_model_of=lambda p, model: "m"))
    hold(index, "p2:1", 10)  # keyed by "m", as its events are
    d = asyncio.run(router.route("alias", PROMPT, PODS))
    assert (d.pod, d.hit_blocks) == ("p2:1", 10)


def test_the_picker_options_set_health_and_flush_knobs():
    import argparse

    from sluice.gateway import options
    from sluice.gateway.core import RoutingCore

    p = argparse.ArgumentParser()
    options.add_routing_arguments(p)

    def core(*argv):
        return RoutingCore(*options.routing_parts(p.parse_args(
            ["--engine", "http://127.0.0.1:1,model=m", *argv])))

    gw = core("--max-failures", "5", "--index-reads", "redis", "--probe-interval", "0.5",
              "--speculative-flush-ms", "25", "--max-ejection-fraction", "0.25")
    assert (gw.health.max_failures, gw.health.probe_interval_s) == (5, 0.5)
    assert gw.health.max_ejection_fraction == 0.25
    assert gw.index.flush_after_s == 0.025 and not gw.index.read_local
    assert core().index.read_local


def test_the_picker_raises_its_open_files_limit_to_the_hard_one():
    import subprocess
    import sys

    code = ("import resource; from sluice.gateway.options import raise_open_files_limit; "
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, h), h)); "
            "raise_open_files_limit(); print(resource.getrlimit(resource.RLIMIT_NOFILE) == (h, h))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_an_adapters_requests_go_where_it_runs_and_a_new_adapter_where_a_slot_is_free():
    """kv_aware's lora-affinity-scorer, from each pod's `vllm:lora_requests_info`
    (--max-loras 2 everywhere): `sql` runs on p2 (whose slots are full), p0 and p1 run two
    other adapters each, p3 runs none."""
    index = PrefixIndex(LocalIndex(), None)
    table = LoadTable(ttl_ms=10_000)
    now = time.time() * 1000
    running = {"p0:1": {"a", "b"}, "p1:1": {"c", "d"}, "p2:1": {"sql", "e"}, "p3:1": set()}
    for pod, loras in running.items():
        table.put(pod, EngineMetrics(waiting=0, running=2, kv_usage=0.1,
                                     running_loras=frozenset(loras), max_loras=2), now)
    router = make_router("kv_aware", index, table, Pods())
    for _ in range(8):  # (cold prompts: ties would be drawn at random)
        assert asyncio.run(router.route("sql", PROMPT, PODS)).pod == "p2:1"
        assert asyncio.run(router.route("new", PROMPT, PODS)).pod == "p3:1"
