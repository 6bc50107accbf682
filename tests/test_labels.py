"""`sluice/labels.py` is the one contract between the operator, which renders engine pods,
and the gateway's discovery, which selects and reads them: pinned on every example pool,
with the selectors evaluated by a real kube-apiserver (a list with labelSelector)."""

from __future__ import annotations

import pathlib
import re
from urllib.parse import quote

import pytest
import yaml
from k8s_kubelet import ready_status

from sluice import labels
from sluice.gateway.discovery import kubernetes as discovery
from sluice.operator.render import RenderConfig, render_pool
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "charts/sluice/examples").glob("pool-*.yaml"))


def _run_pods(plane, ns: str, example: pathlib.Path, config: RenderConfig = RenderConfig(),
              pool: str | None = None, suffix: str = "0") -> list[str]:
    """A pod of each Deployment the operator renders for `example` (named `pool` if given),
    created on the server from its template as it is and reported running and ready as the
    kubelet would: their names."""
    body = yaml.safe_load(example.read_text())
    body["metadata"].update(uid="uid-1", namespace=ns, **({"name": pool} if pool else {}))
    names = []
    for dep in (m for m in render_pool(PoolSpec.from_body(body), config)
                if m["kind"] == "Deployment"):
        template = dep["spec"]["template"]
        name = f"{dep['metadata']['name']}-{suffix}"
        plane.request("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "spec": template["spec"],
            "metadata": {**template["metadata"], "name": name, "namespace": ns}})
        plane.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                      {"status": ready_status(len(names))},
                      content_type="application/merge-patch+json")
        names.append(name)
    return names


def _selected(plane, ns: str, selector: str) -> list[dict]:
    """The pods the server lists for `selector`, as the API's JSON (what discovery reads)."""
    pods = plane.request("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector={quote(selector)}")
    return sorted(pods["items"], key=lambda p: p["metadata"]["name"])


def _names(pods: list[dict]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_discovery_selects_and_reads_every_engine_pod_the_operator_renders(
        example, kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    body = yaml.safe_load(example.read_text())
    pool, model = body["metadata"]["name"], body["spec"]["model"]["name"]
    ours = sorted(_run_pods(plane, ns, example))
    others = sorted(_run_pods(plane, ns, example, pool="another-pool"))
    assert ours and len(others) == len(ours)
    assert _names(_selected(plane, ns, labels.engine_selector())) == sorted(ours + others)
    assert _names(_selected(plane, ns, labels.pool_selector(pool))) == ours  # the operator's
    assert _selected(plane, ns, labels.engine_selector("no-such-pool")) == []
    pods = _selected(plane, ns, labels.engine_selector(pool))
    assert _names(pods) == ours
    for pod in pods:
        ep = discovery.pod_endpoint(pod, "ignored")
        ip = pod["status"]["podIP"]
        assert (ep.model, ep.pool, ep.namespace) == (model, pool, ns)
        assert (ep.url, ep.events, ep.replay) == (
            f"http://{ip}:{labels.HTTP_PORT}", f"tcp://{ip}:{labels.KV_EVENTS_PORT}",
            f"tcp://{ip}:{labels.KV_REPLAY_PORT}")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_discovery_reads_which_pods_speak_curve_on_their_event_sockets(
        example, kube_controllers, kube_ns):
    """Sluice engines with the CURVE Secret say so; vLLM pods, and every pod without the
    Secret, say their sockets are plain: one picker with keys reads both kinds."""
    plane, ns = kube_controllers, kube_ns
    vllm = yaml.safe_load(example.read_text())["spec"]["engine"]["kind"] == "vllm"
    for i, (config, curve) in enumerate(((RenderConfig(), False),
                                         (RenderConfig(kv_events_curve_secret="keys"),
                                          not vllm))):
        names = _run_pods(plane, ns, example, config, suffix=str(i))
        pods = [p for p in _selected(plane, ns, labels.engine_selector())
                if p["metadata"]["name"] in names]
        assert _names(pods) == sorted(names)
        for pod in pods:
            assert discovery.pod_endpoint(pod, ns).events_curve is curve


def test_one_owner_of_the_label_names():
    """No other module spells the engine pods' labels, annotation or names itself."""
    owned = re.compile(r'"(sluice\.dev/(pool|role|model|spec-hash|kv-events-curve)|sluice-engine|sluice-operator)"')
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "sluice").rglob("*.py")
                 if path.name != "labels.py" and owned.search(path.read_text())]
    assert offenders == []
