"""LoRA adapters on running engines: `lora.LoraSyncer` against engines' runtime LoRA
endpoints served for real on loopback (`fake_lora_engine`: vLLM's three endpoints behind
the engine key), then the real operator on a real kube-apiserver and
kube-controller-manager loading, unloading and counting adapters on the pods the
Deployment controller made, without rolling them."""

from __future__ import annotations

import asyncio
import copy
import pathlib

import httpx
import pytest
import yaml
from fake_engine import ThreadServer
from fake_lora_engine import LoopbackTransport, LoraEngines
from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet

from sluice.local.stack import free_port
from sluice.operator import kube
from sluice.operator.lora import LoraSyncer
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_POOL = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
BASE = CPU_POOL["spec"]["model"]["name"]
KEY = "sk-engine-test"


@pytest.fixture
def engines():
    fake = LoraEngines(base=BASE, api_key=KEY)
    with ThreadServer(fake.app) as server:
        fake.url = server.url
        yield fake


def _pool(loras: list[dict], **engine_lora) -> PoolSpec:
    body = copy.deepcopy(CPU_POOL)
    body["metadata"]["uid"] = "uid-1"
    body["spec"]["engine"]["lora"] = engine_lora
    body["spec"]["loras"] = loras
    return PoolSpec.from_body(body)


def _image(name: str, path: str | None = None) -> dict:
    return {"name": name, "source": {"image": {"path": path or f"/adapters/{name}"}}}


def _pod(name: str, ip: str | None, ready: bool = True, claims: dict | None = None) -> dict:
    """An engine pod as the API server lists it; `claims`: claim -> where it is mounted."""
    volumes = [{"name": f"v{i}", "persistentVolumeClaim": {"claimName": c}}
               for i, c in enumerate(claims or {})]
    mounts = [{"name": f"v{i}", "mountPath": path} for i, path in enumerate((claims or {})
                                                                            .values())]
    return {"metadata": {"name": name},
            "spec": {"volumes": volumes, "containers": [{"name": "engine",
                                                         "volumeMounts": mounts}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


PODS = [_pod("p0", "10.0.0.1"), _pod("p1", "10.0.0.2"), _pod("p2", "10.0.0.3", ready=False),
        _pod("p3", None)]


def _sync(url: str, pool: PoolSpec, pods: list[dict], key: str | None = KEY, **timeouts):
    async def go():
        async with httpx.AsyncClient(transport=LoopbackTransport(url)) as http:
            return await LoraSyncer(http, key, **timeouts).sync(pool, pods)
    return asyncio.run(go())


def test_adapters_are_loaded_into_every_ready_engine_and_counted(engines):
    pool = _pool([_image("sql"), {"name": "chat", "source": {"huggingFace": {"repo": "o/chat"}}}])
    report = _sync(engines.url, pool, PODS)
    want = {"sql": "/adapters/sql", "chat": "o/chat"}  # a Hub adapter by its repository
    assert engines.adapters == {"10.0.0.1:8000": want, "10.0.0.2:8000": want}
    assert report.status == [{"name": "sql", "readyReplicas": 2},
                             {"name": "chat", "readyReplicas": 2}]
    assert report.loaded == {"sql": 2, "chat": 2} and report.problems == []
    calls = len(engines.calls)
    again = _sync(engines.url, pool, PODS)  # level-based: nothing left to do
    assert len(engines.calls) == calls and again.status == report.status
    assert not again.loaded and not again.unloaded


def test_removed_and_repointed_adapters_are_unloaded_and_the_rest_kept(engines):
    for host in ("10.0.0.1:8000", "10.0.0.2:8000"):
        engines.adapters[host] = {"sql": "/adapters/sql-v1", "chat": "/adapters/chat",
                                  "stray": "/by/hand"}
    report = _sync(engines.url, _pool([_image("sql"), _image("chat")]), PODS)
    assert engines.serving("10.0.0.1:8000") == {"sql": "/adapters/sql",
                                                "chat": "/adapters/chat"}
    assert report.unloaded == {"sql": 2, "stray": 2} and report.loaded == {"sql": 2}
    assert [c[1:] for c in engines.calls if c[0] == "10.0.0.1:8000"] == [
        ("unload", {"lora_name": "sql"}), ("unload", {"lora_name": "stray"}),
        ("load", {"lora_name": "sql", "lora_path": "/adapters/sql"})]
    # the last adapter removed: unloaded everywhere, the engines keep LoRA on
    report = _sync(engines.url, _pool([]), PODS)
    assert engines.serving("10.0.0.2:8000") == {} and report.status == []


def test_an_engine_that_refuses_a_load_is_not_counted_and_the_problem_says_why(engines):
    engines.failing.add("10.0.0.2:8000")
    report = _sync(engines.url, _pool([_image("sql")]), PODS)
    assert report.status == [{"name": "sql", "readyReplicas": 1}]
    message = ("pod p1: adapter sql not loaded from /adapters/sql: HTTP 400: Loading lora sql "
               "failed: No adapter found for /adapters/sql")
    assert report.problems == [("LoraLoadFailed", message)]
    # on more engines: one problem per adapter, naming the first
    engines.failing.add("10.0.0.5:8000")
    report = _sync(engines.url, _pool([_image("sql"), _image("math")]),
                   PODS + [_pod("p4", "10.0.0.5")])
    assert [p[1][:50] for p in report.problems] == [
        "pod p1: adapter math not loaded from /adapters/mat",
        "pod p1: adapter sql not loaded from /adapters/sql:"]
    assert report.problems[0][1].endswith("(and 1 more engines)")


def test_an_engine_that_cannot_be_read_counts_for_no_adapter(engines):
    report = _sync(engines.url, _pool([_image("sql")]), PODS[:1], key="wrong")
    assert report.status == [{"name": "sql", "readyReplicas": 0}]
    message = "pod p0: GET /v1/models failed: HTTP 401: Incorrect or missing API key"
    assert report.problems == [("LoraListFailed", message)]
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    (problem,) = _sync(closed, _pool([_image("sql")]), PODS[:1]).problems
    assert problem[0] == "LoraListFailed" and "ConnectError" in problem[1]


def test_an_engine_that_leaves_a_load_unanswered_is_asked_nothing_more_this_pass(engines):
    engines.hanging.add("10.0.0.2:8000")
    report = _sync(engines.url, _pool([_image("a"), _image("b"), _image("c")]), PODS,
                   load_timeout_s=0.5)
    assert [c[2]["lora_name"] for c in engines.calls if c[0] == "10.0.0.2:8000"] == ["a"]
    assert report.status == [{"name": n, "readyReplicas": 1} for n in "abc"]
    (problem,) = report.problems
    assert problem == ("LoraLoadFailed", "pod p1: adapter a not loaded from /adapters/a: ReadTimeout")


def test_a_pvc_adapter_loads_where_each_pod_mounts_its_claim(engines):
    pods = [_pod("new", "10.0.0.1", claims={"team": "/loras/team"}),
            _pod("old", "10.0.0.2")]  # from the template before the claim: rolling out
    report = _sync(engines.url, _pool([{"name": "sql", "source": {
        "pvc": {"claimName": "team", "path": "sql"}}}]), pods)
    assert engines.serving("10.0.0.1:8000") == {"sql": "/loras/team/sql"}
    assert engines.serving("10.0.0.2:8000") == {}
    assert report.status == [{"name": "sql", "readyReplicas": 1}] and report.problems == []


def test_pools_without_lora_are_not_asked(engines):
    body = copy.deepcopy(CPU_POOL)
    body["metadata"]["uid"] = "uid-1"
    assert _sync(engines.url, PoolSpec.from_body(body), PODS) is None
    assert engines.calls == []


def test_an_ipv6_engine_is_reached_by_its_bracketed_address(engines):
    report = _sync(engines.url, _pool([_image("sql")]), [_pod("p6", "fd00::6")])
    assert engines.serving("[fd00::6]:8000") == {"sql": "/adapters/sql"}
    assert report.status == [{"name": "sql", "readyReplicas": 1}]


# The real operator: each pod the kubelet stand-in reports has its own IP; the operator's
# requests to <ip>:8000 reach the loopback engines, which tell the pods apart by that.

def _run(scenario):
    asyncio.run(asyncio.wait_for(scenario(), 90))


def _body(loras: list[dict], replicas: int = 2) -> dict:
    body = copy.deepcopy(CPU_POOL)
    body["spec"].update(replicas=replicas, loras=loras)
    body["spec"]["engine"]["lora"] = {"maxLoras": 2}
    return body


async def _loras(view: View) -> list[dict]:
    return ((await view.pool()).get("status") or {}).get("loras")


async def _hosts(view: View) -> list[str]:
    return sorted(f"{e['ip']}:8000" for e in (await view.pool())["status"]["endpoints"])


def test_the_operator_loads_and_unloads_adapters_without_rolling_the_engines(
        kube_controllers, kube_ns, engines):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, kubelet(api, ns),
                    operator(plane, namespaces=(ns,), transport=LoopbackTransport(engines.url),
                             engine_api_key=KEY)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, _body([_image("sql"), _image("chat")]))
            both = [{"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 2}]
            await eventually(lambda: _is(_loras(view), both), 30, "both adapters on both pods")
            hosts = await _hosts(view)
            assert all(set(engines.serving(h)) == {"sql", "chat"} for h in hosts)
            dep = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
            pods = await view.names(kube.PODS)
            assert "--enable-lora" in dep["spec"]["template"]["spec"]["containers"][0]["args"]

            await api.patch(kube.POOLS, ns, "smollm2", {"spec": {"loras": [
                _image("sql"), _image("math")]}})  # (a merge patch replaces the list)
            swapped = [{"name": "sql", "readyReplicas": 2}, {"name": "math", "readyReplicas": 2}]
            await eventually(lambda: _is(_loras(view), swapped), 20, "chat out, math in")
            assert all(set(engines.serving(h)) == {"sql", "math"} for h in hosts)
            after = await view.get(kube.DEPLOYMENTS, "smollm2-serve")
            assert after["metadata"]["generation"] == dep["metadata"]["generation"]
            assert after["spec"]["template"] == dep["spec"]["template"]
            assert await view.names(kube.PODS) == pods  # the same engines, none restarted
            events = await view.events()
            assert ("LoraLoaded", "loaded adapter math on 2 engines") in events
            assert ("LoraUnloaded", "unloaded adapter chat on 2 engines") in events
            # a new engine gets the adapters once it is ready
            await api.patch(kube.POOLS, ns, "smollm2", {"spec": {"replicas": 3}},
                            subresource="scale")
            three = [{"name": "sql", "readyReplicas": 3}, {"name": "math", "readyReplicas": 3}]
            await eventually(lambda: _is(_loras(view), three), 30, "the third engine serving")
    _run(scenario)


def test_an_engine_that_fails_a_load_degrades_the_pool_until_it_loads(
        kube_controllers, kube_ns, engines):
    plane, ns = kube_controllers, kube_ns

    async def scenario():
        async with (client(plane.admin_kubeconfig) as api, kubelet(api, ns),
                    operator(plane, namespaces=(ns,), transport=LoopbackTransport(engines.url),
                             engine_api_key=KEY, resync_interval_s=1.0)):
            view = View(api, ns)
            await api.create(kube.POOLS, ns, _body([]))
            await eventually(lambda: view.ready(2), 30, "two engines, no adapters")
            broken = (await _hosts(view))[0]
            engines.failing.add(broken)
            await api.patch(kube.POOLS, ns, "smollm2", {"spec": {"loras": [_image("sql")]}})
            await eventually(lambda: _is(_loras(view), [{"name": "sql", "readyReplicas": 1}]),
                             20, "sql on the healthy engine only")
            degraded = await eventually(lambda: _degraded(view), 10, "Degraded")
            assert degraded["reason"] == "LoraLoadFailed"
            assert "adapter sql not loaded from /adapters/sql: HTTP 400" in degraded["message"]
            assert (await view.condition("Ready"))["status"] == "False"
            await eventually(lambda: _reasons(view, "LoraLoadFailed"), 10, "a Warning Event")
            engines.failing.clear()  # the engine recovers: the resync loads it there
            await eventually(lambda: _is(_loras(view), [{"name": "sql", "readyReplicas": 2}]),
                             20, "sql on both engines")
            await eventually(lambda: view.ready(2), 10, "Ready again")
    _run(scenario)


async def _is(value, expected) -> bool:
    return await value == expected


async def _degraded(view: View) -> dict | None:
    condition = await view.condition("Degraded")
    return condition if condition and condition["status"] == "True" else None


async def _reasons(view: View, reason: str) -> bool:
    return any(r == reason for r, _ in await view.events())
