"""The Helm chart: lint --strict, render default and non-default values, every manifest
valid for Kubernetes 1.30 and 1.37, least-privilege RBAC, non-root pods, pinned images."""

from __future__ import annotations

import pathlib
import subprocess

import k8s_schema
import pytest
import yaml
from k8s_tools import tool

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sluice"
VERSIONS = ("1.30", "1.37")

NON_DEFAULT = [
    "operator.watchNamespaces={team-a,team-b}", "operator.replicas=1",
    "operator.logLevel=debug", "redis.enabled=false", "redis.existingSecret=redis-url",
    "gateway.autoscaling.enabled=true", "gateway.pool=llama-8b",
    "gateway.watchNamespace=team-a", "gateway.routing=least_load",
    "gateway.service.type=LoadBalancer", "gateway.extraArgs={--max-retries=3}",
    "monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
    "monitoring.grafanaDashboard.enabled=false", "imagePullSecrets[0].name=regcred",
    "operator.priorityClassName=system-cluster-critical",
]


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def render(*sets: str) -> list[dict]:
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", "rel", str(CHART), "--namespace", "sluice", *flags)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def default():
    return render()


@pytest.fixture(scope="module")
def custom():
    return render(*NON_DEFAULT)


def _chart_crds() -> dict[tuple[str, str], dict]:
    crds = {}
    for path in (CHART / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            crds[(doc["spec"]["group"], doc["spec"]["names"]["kind"])] = doc
    return crds


def _validate(manifests: list[dict], version: str) -> None:
    import kubernetes_validate

    crds = _chart_crds()
    for m in manifests:
        group = m["apiVersion"].rsplit("/", 1)[0] if "/" in m["apiVersion"] else ""
        if (group, m["kind"]) in crds:  # our own CRDs: validate against their schema
            _, errors = k8s_schema.validate(k8s_schema.crd_schema(crds[group, m["kind"]]), m)
            assert errors == [], (m["kind"], errors)
        elif group == "monitoring.coreos.com":  # Prometheus Operator CRDs are not in the schemas
            assert m["kind"] in ("ServiceMonitor", "PodMonitor") and m["spec"]["selector"]
        else:
            kubernetes_validate.validate(m, version, strict=True)


@pytest.mark.parametrize("values", [
    [], ["--set", "redis.persistence.enabled=true"],
    [f for s in NON_DEFAULT for f in ("--set", s)]], ids=["default", "persistence", "custom"])
def test_helm_lint_strict(values):
    out = helm("lint", "--strict", str(CHART), *values)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_default_render_is_valid(default, version):
    kinds = sorted({m["kind"] for m in default})
    assert {"Deployment", "StatefulSet", "ClusterRole", "Role", "ConfigMap"} <= set(kinds)
    _validate(default, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_non_default_render_is_valid(custom, version):
    kinds = {m["kind"] for m in custom}
    assert {"HorizontalPodAutoscaler", "ServiceMonitor", "PodMonitor", "KopfPeering"} <= kinds
    assert "StatefulSet" not in kinds and "ClusterKopfPeering" not in kinds
    _validate(custom, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_crd_files_are_valid(version):
    import kubernetes_validate

    for crd in _chart_crds().values():
        kubernetes_validate.validate(crd, version, strict=True)


def test_values_schema_rejects_bad_values():
    out = helm("template", "rel", str(CHART), "--set", "gateway.routing=bogus")
    assert out.returncode != 0 and "routing" in out.stderr
    out = helm("template", "rel", str(CHART), "--set", "operator.typo=1")
    assert out.returncode != 0


def _by(manifests, kind, suffix):
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(suffix))


def test_rbac_is_least_privilege(default):
    operator = _by(default, "ClusterRole", "-operator")
    resources = {r for rule in operator["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "*" not in resources
    assert all("*" not in rule["verbs"] for rule in operator["rules"])
    pods = next(rule for rule in operator["rules"] if "pods" in rule["resources"])
    assert set(pods["verbs"]) == {"get", "list", "watch"}
    gateway = _by(default, "Role", "-gateway")
    assert {v for rule in gateway["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert {r for rule in gateway["rules"] for r in rule["resources"]} == {"inferencepools", "pods"}


@pytest.mark.parametrize("which", ["default", "custom"])
def test_pods_are_non_root_with_pinned_images(which, request):
    manifests = request.getfixturevalue(which)
    for m in manifests:
        if m["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = m["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, m["metadata"]["name"]
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image


def test_operator_and_gateway_are_wired_to_redis_and_namespaces(default, custom):
    op = _by(default, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in op["env"]}
    assert env["SLUICE_REDIS_URL"]["value"] == "redis://rel-sluice-redis:6379/0"
    assert "--peering=rel-sluice" in op["args"]
    op = _by(custom, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in op["env"]}
    assert env["SLUICE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "redis-url"
    assert "--namespace=team-a" in op["args"] and "--namespace=team-b" in op["args"]
    gw = _by(custom, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "--pool=llama-8b" in gw["args"] and "--discovery=kubernetes" in gw["args"]
    assert _by(custom, "Role", "-gateway")["metadata"]["namespace"] == "team-a"
    config = _by(custom, "ConfigMap", "-gateway")["data"]
    assert config["SLUICE_ROUTING"] == "least_load"
