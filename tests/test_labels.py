"""`sluice/labels.py` is the one contract between the operator, which renders engine pods,
and the gateway's discovery, which selects and reads them: pinned on every example pool."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml
from k8s_store import selector_matches

from sluice import labels
from sluice.gateway.discovery import kubernetes as discovery
from sluice.operator.render import RenderConfig, render_pool
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "charts/sluice/examples").glob("pool-*.yaml"))


def _pods(example: pathlib.Path, config: RenderConfig = RenderConfig()) -> list[dict]:
    """Pods as the kubelet would run them from each rendered Deployment, in the shape the
    `kubernetes` client hands the discovery (snake_case)."""
    body = yaml.safe_load(example.read_text())
    body["metadata"].update(uid="uid-1", namespace="team-a")
    pods = []
    for i, dep in enumerate(m for m in render_pool(PoolSpec.from_body(body), config)
                            if m["kind"] == "Deployment"):
        template = dep["spec"]["template"]
        ports = [{"name": p["name"], "container_port": p["containerPort"]}
                 for p in template["spec"]["containers"][0]["ports"]]
        pods.append({"metadata": {"name": f"{dep['metadata']['name']}-0", "namespace": "team-a",
                                  "labels": template["metadata"]["labels"],
                                  "annotations": template["metadata"]["annotations"]},
                     "spec": {"containers": [{"ports": ports}]},
                     "status": {"pod_ip": f"10.0.0.{i + 1}",
                                "conditions": [{"type": "Ready", "status": "True"}]}})
    return pods


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_discovery_selects_and_reads_every_engine_pod_the_operator_renders(example):
    body = yaml.safe_load(example.read_text())
    pool, model = body["metadata"]["name"], body["spec"]["model"]["name"]
    for pod in _pods(example):
        meta = pod["metadata"]
        assert selector_matches(labels.engine_selector(), meta["labels"])
        assert selector_matches(labels.engine_selector(pool), meta["labels"])
        assert not selector_matches(labels.engine_selector("another-pool"), meta["labels"])
        assert selector_matches(labels.pool_selector(pool), meta["labels"])  # the operator's
        ep = discovery.pod_endpoint(pod, "ignored")
        ip = pod["status"]["pod_ip"]
        assert (ep.model, ep.pool, ep.namespace) == (model, pool, "team-a")
        assert (ep.url, ep.events, ep.replay) == (
            f"http://{ip}:{labels.HTTP_PORT}", f"tcp://{ip}:{labels.KV_EVENTS_PORT}",
            f"tcp://{ip}:{labels.KV_REPLAY_PORT}")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_discovery_reads_which_pods_speak_curve_on_their_event_sockets(example):
    """Sluice engines with the CURVE Secret say so; vLLM pods, and every pod without the
    Secret, say their sockets are plain: one picker with keys reads both kinds."""
    vllm = yaml.safe_load(example.read_text())["spec"]["engine"]["kind"] == "vllm"
    for config, curve in ((RenderConfig(), False),
                          (RenderConfig(kv_events_curve_secret="keys"), not vllm)):
        for pod in _pods(example, config):
            assert discovery.pod_endpoint(pod, "ns").events_curve is curve


def test_one_owner_of_the_label_names():
    """No other module spells the engine pods' labels, annotation or names itself."""
    owned = re.compile(r'"(sluice\.dev/(pool|role|model|spec-hash|kv-events-curve)|sluice-engine|sluice-operator)"')
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "sluice").rglob("*.py")
                 if path.name != "labels.py" and owned.search(path.read_text())]
    assert offenders == []
