"""Autoscaler decisions on synthetic load series, metric parsing, and the operator's
periodic work scaling a pool on a real API server (with kube-controller-manager and the
kubelet stand-in) through its scale subresource, with an Event."""

from __future__ import annotations

import asyncio
import pathlib
import random

import yaml
from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet

from sluice.operator import kube, metrics
from sluice.operator.autoscale import LoadSample, decide
from sluice.operator.spec import AutoscalingSpec

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "charts/sluice/examples"
POLICY = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=6,
                         target_kv_cache_usage=0.7, target_queue_depth=8,
                         scale_up_stabilization_s=30, scale_down_stabilization_s=120)


def simulate(series, policy=POLICY, start=2, step=10.0, role="serve"):
    """Feed (kv, queue) samples every `step` s; returns the replica count after each."""
    replicas, history, out = start, (), []
    for i, load in enumerate(series):
        sample = None if load is None else LoadSample(load[0], load[1], replicas)
        d = decide(policy, replicas, sample, history, now=i * step, role=role)
        replicas, history = d.replicas, d.history
        out.append(replicas)
    return out


def test_sustained_kv_pressure_scales_up_after_the_window():
    out = simulate([(0.95, 0)] * 10)
    # 0.95 / 0.7 → ceil(2 × 1.36) = 3, but only once the 30 s window saw it throughout
    assert out[:3] == [2, 2, 2] and out[3] == 3
    assert out[-1] > 3 and max(out) <= POLICY.max_replicas


def test_a_single_spike_inside_the_window_does_not_scale():
    out = simulate([(0.5, 0), (0.99, 40), (0.5, 0), (0.5, 0), (0.5, 0)])
    assert out == [2, 2, 2, 2, 2]


def test_queue_depth_alone_scales_up():
    out = simulate([(0.3, 24)] * 5)
    assert out[-1] > 2


def test_idle_scales_down_only_after_the_down_window():
    out = simulate([(0.0, 0)] * 20, start=4)
    first_drop = out.index(next(x for x in out if x < 4))
    assert first_drop * 10 >= POLICY.scale_down_stabilization_s
    assert out[-1] == POLICY.min_replicas


def test_each_role_scales_on_its_own_signal():
    """prefill on waiting requests only, decode on KV usage only; serve on either."""
    queue_only, kv_only = [(0.05, 24)] * 20, [(0.95, 0)] * 20  # past both windows
    assert simulate(queue_only, role="prefill")[-1] > 2
    assert simulate(kv_only, role="prefill")[-1] < 2  # a full cache (held for pulls): idle
    assert simulate(kv_only, role="decode")[-1] > 2
    assert simulate(queue_only, role="decode")[-1] < 2  # a queue alone: no new decode pods
    assert simulate(queue_only)[-1] > 2 and simulate(kv_only)[-1] > 2
    d = decide(POLICY, 2, LoadSample(0.95, 24, 2), (), 0.0, role="decode")
    assert "KV cache usage" in d.message and "queue" not in d.message


def test_within_tolerance_holds_steady():
    assert simulate([(0.72, 0)] * 10) == [2] * 10


def test_no_metrics_holds_but_enforces_bounds():
    assert simulate([None] * 3, start=3) == [3, 3, 3]
    assert simulate([None], start=9) == [POLICY.max_replicas]


def test_never_outside_min_max_on_random_series():
    rng = random.Random(0)
    for _ in range(200):
        series = [None if rng.random() < 0.1 else (rng.random(), rng.random() * 40)
                  for _ in range(30)]
        out = simulate(series, start=rng.randint(1, 6), step=rng.choice([1.0, 15.0, 60.0]))
        assert all(POLICY.min_replicas <= r <= POLICY.max_replicas for r in out)


def test_parse_engine_metrics():
    text = """# HELP vllm:kv_cache_usage_perc KV usage
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_running{model_name="m"} 7.0
"""
    assert metrics.engine_load(text) == (0.42, 3.0)
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    assert metrics.engine_load(old) == (0.5, 0.0)
    assert metrics.engine_load("other 1\n") is None
    assert metrics.aggregate([(0.2, 1.0), (0.6, 3.0)]) == LoadSample(0.4, 2.0, 2)


def test_timer_scales_the_pool_and_posts_an_event(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    body = yaml.safe_load((EXAMPLES / "pool-cpu.yaml").read_text())
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                   "scaleUpStabilizationSeconds": 0,
                                   "scaleDownStabilizationSeconds": 0}
    load = {"kv": 0.99}

    async def sampler(endpoints, role):
        ready = [e for e in endpoints if e["ready"] and e["role"] == role]
        return LoadSample(load["kv"], 0.0, len(ready)) if ready else None

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,), sampler=sampler, autoscale_interval_s=0.2),
                    kubelet(api, ns)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, body)
            await eventually(lambda: _spec_replicas(view, 3), 30, "scaled to max")
            await eventually(lambda: _deployment_replicas(view, "smollm2-serve", 3), 30,
                             "Deployment follows")
            status = (await view.pool())["status"]
            assert status["kvCacheUsage"] == 0.99 and status["lastScaleTime"]
            await eventually(lambda: _reason(view, "ScaledUp"), 30, "a ScaledUp event")
            load["kv"] = 0.0
            await eventually(lambda: _spec_replicas(view, 1), 30, "scaled to min")
            await eventually(lambda: _reason(view, "ScaledDown"), 30, "a ScaledDown event")
    asyncio.run(asyncio.wait_for(scenario(), 150))


async def _spec_replicas(view: View, n: int) -> bool:
    return (await view.pool())["spec"]["replicas"] == n


async def _deployment_replicas(view: View, name: str, n: int) -> bool:
    return (await view.get(kube.DEPLOYMENTS, name))["spec"]["replicas"] == n


async def _reason(view: View, reason: str) -> bool:
    return reason in [r for r, _ in await view.events()]


def test_timer_scales_prefill_and_decode_each_on_its_own_signal(kube_controllers, kube_ns):
    """A prefill/decode pool whose prefill engines have a queue and whose decode engines
    have a nearly full cache: both roles grow, each through spec.roles.<role>.replicas;
    then the queue drains but the cache stays full: only prefill shrinks."""
    plane, ns = kube_controllers, kube_ns
    body = yaml.safe_load((EXAMPLES / "pool-disaggregated.yaml").read_text())
    for role in ("prefill", "decode"):
        body["spec"]["roles"][role]["autoscaling"] = {
            "enabled": True, "minReplicas": 1, "maxReplicas": 4,
            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0}
    # (kv, waiting) per role: the other signal is set to the opposite extreme, so a role
    # scaled on the wrong signal moves the wrong way
    load = {"prefill": (0.99, 30.0), "decode": (0.99, 0.0)}

    async def sampler(endpoints, role):
        ready = [e for e in endpoints if e["ready"] and e["role"] == role]
        return LoadSample(*load[role], len(ready)) if ready else None

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api,
                    operator(plane, namespaces=(ns,), sampler=sampler, autoscale_interval_s=0.2),
                    kubelet(api, ns)):
            view = View(api, ns, "qwen3-pd")

            async def roles() -> tuple[int, int]:
                spec = (await view.pool())["spec"]["roles"]
                return spec["prefill"]["replicas"], spec["decode"]["replicas"]

            await api.create(kube.POOLS, ns, body)
            await eventually(lambda: _equals(roles(), (4, 4)), 60, "both up")
            load["prefill"] = (0.99, 0.0)  # queue drained (its KV held for pulls)
            await eventually(lambda: _first(roles(), 1), 60, "prefill down")
            assert (await roles())[1] == 4
            await eventually(lambda: _deployment_replicas(view, "qwen3-pd-prefill", 1), 30,
                             "the prefill Deployment follows")
    asyncio.run(asyncio.wait_for(scenario(), 180))


async def _equals(value, expected) -> bool:
    return await value == expected


async def _first(value, expected) -> bool:
    return (await value)[0] == expected


def test_sample_pool_scrapes_ready_engines_of_the_role_and_skips_failures():
    import httpx

    pages = {"10.0.0.1": "vllm:kv_cache_usage_perc 0.2\nvllm:num_requests_waiting 2\n",
             "10.0.0.2": "vllm:kv_cache_usage_perc 0.6\nvllm:num_requests_waiting 4\n"}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics" and request.url.port == 8000
        page = pages.get(request.url.host)
        return httpx.Response(200, text=page) if page else httpx.Response(503)

    endpoints = [
        {"url": f"http://{ip}:8000", "ready": ready, "role": role}
        for ip, ready, role in [("10.0.0.1", True, "serve"), ("10.0.0.2", True, "serve"),
                                ("10.0.0.3", True, "serve"),  # answers 503: left out
                                ("10.0.0.4", False, "serve"), ("10.0.0.5", True, "decode")]]

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await metrics.sample_pool(http, endpoints, "serve", timeout=1.0)

    sample = asyncio.run(scenario())
    assert sample == LoadSample(0.4, 3.0, 2)


def test_the_operator_and_the_picker_read_a_data_parallel_pod_alike():
    """One parser for both (`sluice/metrics_text.py`): a data-parallel vLLM pod exports a
    KV-usage series per engine, each a fraction of its own cache: the mean, not the sum."""
    from sluice.metrics_text import parse_engine_metrics

    text = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6\n'
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.8\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 3\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1\n'
            'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4\n')
    kv, waiting = metrics.engine_load(text)
    assert (round(kv, 6), waiting) == (0.7, 5.0)
    picker = parse_engine_metrics(text)
    assert round(picker.kv_usage, 6) == 0.7 and picker.waiting == 5.0
    assert (picker.block_size, picker.num_gpu_blocks) == (16, 4096)
    assert not parse_engine_metrics("not prometheus {{{\n").reports_kv
