"""The Helm chart: lint --strict, render default, non-default and GIE-mode values, every
manifest accepted by a real kube-apiserver (server-side dry-run: its schemas, our CRDs',
admission) and valid for Kubernetes 1.30 and 1.37 (kubernetes-validate's schemas: versions
the test server is not), least-privilege RBAC, non-root pods, pinned images. The gateway's
wiring (Envoy, picker, engines Service) is in test_chart_gateway.py."""

from __future__ import annotations

import pytest
import yaml
from kube_chart import CHART, CHART_CRDS, helm, install_crds, render, server_errors

from sluice import labels

VERSIONS = ("1.30", "1.37")
# the Gateway's data plane in a namespace of its own
GATEWAY_NS = "envoy-gateway-system"
GATEWAY_FROM = ("networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels."
                f"kubernetes\\.io/metadata\\.name={GATEWAY_NS}")
GIE = ["gie.enabled=true", "gie.failureMode=FailOpen", GATEWAY_FROM]

NON_DEFAULT = [
    "watchNamespaces={team-a}", "operator.replicas=1",
    "operator.logLevel=debug", "redis.enabled=false", "redis.existingSecret=redis-url",
    "picker.autoscaling.enabled=true", "envoy.autoscaling.enabled=true", "picker.pool=llama-8b",
    "picker.routing=least_load", "picker.pdThresholdTokens=512",
    "picker.config.configMap.name=epp-config", "picker.objectives={interactive=10}",
    "envoy.service.type=LoadBalancer", "picker.extraArgs={--max-fallbacks=3}",
    "envoy.bootstrapArgs={--num-retries=3}", "picker.tokenizers={llama=/tokenizers/llama}",
    "picker.extraVolumes[0].name=tokenizers", "picker.extraVolumes[0].configMap.name=tok",
    "picker.extraVolumeMounts[0].name=tokenizers",
    "picker.extraVolumeMounts[0].mountPath=/tokenizers",
    "envoy.service.annotations.example\\.com/lb=internal", "envoy.logLevel=debug",
    "monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
    "monitoring.grafanaDashboard.enabled=false", "imagePullSecrets[0].name=regcred",
    "operator.priorityClassName=system-cluster-critical",
]


__all__ = ["CHART", "GATEWAY_FROM", "GIE", "NON_DEFAULT", "VERSIONS", "_validate", "helm", "render"]
VALUES = {"default": [], "persistence": ["redis.persistence.enabled=true"],
          "custom": NON_DEFAULT, "gie": GIE}


@pytest.fixture(scope="module")
def default():
    return render()


@pytest.fixture(scope="module")
def custom():
    return render(*NON_DEFAULT)


@pytest.fixture(scope="module")
def gie():
    return render(*GIE)


def _chart_crds() -> dict[tuple[str, str], dict]:
    crds = {}
    for path in (CHART / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            crds[(doc["spec"]["group"], doc["spec"]["names"]["kind"])] = doc
    return crds


def _group(manifest: dict) -> str:
    return manifest["apiVersion"].rsplit("/", 1)[0] if "/" in manifest["apiVersion"] else ""


def _validate(manifests: list[dict], version: str) -> None:
    """Valid for Kubernetes `version` by its published schemas (built-in kinds; our own
    CRDs' objects are judged by the real API server: `test_renders_are_accepted_...`)."""
    import kubernetes_validate

    crds = _chart_crds()
    for m in manifests:
        group = _group(m)
        if (group, m["kind"]) in crds:
            continue
        if group == "monitoring.coreos.com":  # Prometheus Operator CRDs are not in the schemas
            assert m["kind"] in ("ServiceMonitor", "PodMonitor") and m["spec"]["selector"]
        else:
            kubernetes_validate.validate(m, version, strict=True)


@pytest.fixture(scope="module")
def plane(kube_plane):
    """The session's API server with the chart's CRDs (the pools', kopf's peerings)."""
    install_crds(kube_plane, *CHART_CRDS)
    return kube_plane


def served(manifests: list[dict]) -> list[dict]:
    """What a cluster without the Prometheus Operator can take: all but its monitors (whose
    CRDs the test server lacks; `_validate` checks their shape)."""
    return [m for m in manifests if _group(m) != "monitoring.coreos.com"]


@pytest.mark.parametrize("which", list(VALUES))
def test_renders_are_accepted_by_the_api_server(plane, kube_ns, which):
    """Every manifest, hooks included, through the real server's validation (strict: an
    unknown field is an error) and admission, released into a namespace of the test's own
    that is also the watched one."""
    values = [f"watchNamespaces={{{kube_ns}}}" if v.startswith("watchNamespaces=") else v
              for v in VALUES[which]]
    manifests = render(*values, namespace=kube_ns)
    assert {m["metadata"].get("namespace", kube_ns) for m in manifests} == {kube_ns}
    assert server_errors(plane, served(manifests)) == ""


def test_the_api_server_refuses_what_it_should(plane, kube_ns):
    """The dry-run judges: an unknown field, a bad value and a bad pool are refused."""
    import copy

    (deployment,) = [m for m in render(namespace=kube_ns) if m["kind"] == "Deployment"
                     and m["metadata"]["name"].endswith("-operator")]
    typo = copy.deepcopy(deployment)
    typo["spec"]["replicaz"] = 1
    assert "replicaz" in server_errors(plane, [typo])
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "Sometimes"
    assert "Sometimes" in server_errors(plane, [deployment])
    pool = yaml.safe_load((CHART / "examples/pool-cpu.yaml").read_text())
    pool["metadata"]["namespace"] = kube_ns
    pool["spec"]["replicas"] = -1
    assert "replicas" in server_errors(plane, [pool])


@pytest.mark.parametrize("example", sorted((CHART / "examples").glob("pool-*.yaml")),
                         ids=lambda p: p.name)
def test_example_pools_are_created_on_the_api_server(plane, kube_ns, example):
    pool = yaml.safe_load(example.read_text())
    plane.kubectl("create", "-n", kube_ns, "-f", str(example))
    stored = yaml.safe_load(plane.kubectl("get", "inferencepools.sluice.dev", "-n", kube_ns,
                                          pool["metadata"]["name"], "-o", "yaml").stdout)
    assert stored["spec"]["model"] == {**stored["spec"]["model"], **pool["spec"]["model"]}


@pytest.mark.parametrize("which", list(VALUES))
def test_helm_lint_strict(which):
    out = helm("lint", "--strict", str(CHART), *[f for s in VALUES[which] for f in ("--set", s)])
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
def test_gie_render_is_valid(gie, version):
    kinds = {m["kind"] for m in gie}
    assert {"Deployment", "Service", "ClusterRole", "Role"} <= kinds
    _validate(gie, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_crd_files_are_valid(version):
    import kubernetes_validate

    for crd in _chart_crds().values():
        kubernetes_validate.validate(crd, version, strict=True)


def test_values_schema_rejects_bad_values():
    out = helm("template", "rel", str(CHART), "--set", "picker.routing=bogus")
    assert out.returncode != 0 and "routing" in out.stderr
    for bad in ("operator.typo=1", "gateway.routing=kv_aware", "gie.failureMode=Maybe",
                "envoy.image.tag=", "envoy.concurrency=0", "envoy.bootstrapArgs={oops}",
                "picker.pdThresholdTokens=-1"):
        out = helm("template", "rel", str(CHART), "--set", bad)
        assert out.returncode != 0, bad


def _by(manifests, kind, suffix):
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(suffix))


def test_rbac_is_least_privilege(default):
    operator = _by(default, "Role", "-operator")  # the release namespace's pools only
    resources = {r for rule in operator["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "*" not in resources
    assert all("*" not in rule["verbs"] for rule in operator["rules"])
    pods = next(rule for rule in operator["rules"] if "pods" in rule["resources"])
    assert set(pods["verbs"]) == {"get", "list", "watch"}
    # blockOwnerDeletion on the children: update on the pools' finalizers, and only that
    finalizers = next(rule for rule in operator["rules"]
                      if "inferencepools/finalizers" in rule["resources"])
    assert finalizers["verbs"] == ["update"] and finalizers["apiGroups"] == ["sluice.dev"]
    picker = _by(default, "Role", "-picker")
    assert {v for rule in picker["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert {r for rule in picker["rules"] for r in rule["resources"]} == {"inferencepools", "pods"}
    assert {g for rule in picker["rules"] for g in rule["apiGroups"]} == {"", "sluice.dev"}
    # nothing for Envoy; the CURVE keys hook's Roles live only while it runs
    # (test_chart_kv_events_curve.py)
    # (the aggregated ClusterRoles for pool authors grant nothing alone: test_chart_rbac.py)
    assert sorted((m["kind"], m["metadata"]["name"]) for m in default
                  if m["kind"] in ("Role", "ClusterRole")
                  and "helm.sh/hook" not in m["metadata"].get("annotations", {})) == [
        ("ClusterRole", "rel-sluice-inferencepools-edit"),
        ("ClusterRole", "rel-sluice-inferencepools-view"),
        ("Role", "rel-sluice-operator"), ("Role", "rel-sluice-picker")]


@pytest.mark.parametrize("which", ["default", "custom", "gie"])
def test_pods_are_non_root_with_pinned_images(which, request):
    manifests = request.getfixturevalue(which)
    for m in manifests:
        if m["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = m["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, m["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["limits"]["memory"], c["name"]
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
    envoy = _by(manifests, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert envoy["automountServiceAccountToken"] is False and "serviceAccountName" not in envoy


def test_operator_and_picker_are_wired_to_redis_and_namespaces(default, custom):
    op = _by(default, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in op["env"]}
    # the chart's Redis has a user per component, whose generated password the URL carries
    assert env["SLUICE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-sluice-redis-auth", "key": "operator"}
    names = [e["name"] for e in op["env"]]
    assert names.index("SLUICE_REDIS_PASSWORD") < names.index("SLUICE_REDIS_URL")
    assert env["SLUICE_REDIS_URL"]["value"] == \
        "redis://operator:$(SLUICE_REDIS_PASSWORD)@rel-sluice-redis:6379/0"
    redis = _by(default, "StatefulSet", "-redis")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert args[args.index("--rename-command") + 1:][:2] == ["CONFIG", ""]
    assert redis["automountServiceAccountToken"] is False
    assert "--peering=rel-sluice" in op["args"]
    op = _by(custom, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in op["env"]}
    assert env["SLUICE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "redis-url"
    assert [a for a in op["args"] if a.startswith("--namespace")] == ["--namespace=team-a"]
    picker = _by(custom, "Deployment", "-picker")["spec"]["template"]["spec"]["containers"][0]
    assert "--pool=llama-8b" in picker["args"] and "--discovery=kubernetes" in picker["args"]
    env = {e["name"]: e for e in picker["env"]}
    assert env["SLUICE_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "redis-url"
    # (read from $SLUICE_REDIS_URL: a password in the URL stays out of the process's argv)
    assert not any(a.startswith("--redis-url") for a in picker["args"])
    assert _by(custom, "Role", "-picker")["metadata"]["namespace"] == "team-a"
    config = _by(custom, "ConfigMap", "-picker")["data"]
    assert config["SLUICE_ROUTING"] == "least_load"
    assert config["SLUICE_PD_THRESHOLD_TOKENS"] == "512"
    assert "--pd-threshold-tokens=$(SLUICE_PD_THRESHOLD_TOKENS)" in picker["args"]
    assert config["SLUICE_DISCOVERY_NAMESPACE"] == "team-a"  # the operator's (one key feeds both)
    for name in ("rel-sluice-picker", "rel-sluice-gateway"):  # autoscaled: the HPA owns replicas
        assert "replicas" not in _by(custom, "Deployment", name)["spec"]
        hpa = _by(custom, "HorizontalPodAutoscaler", name)["spec"]["scaleTargetRef"]
        assert (hpa["kind"], hpa["name"]) == ("Deployment", name)
    assert _by(custom, "ServiceMonitor", "-picker")["spec"]["endpoints"][0]["port"] == "metrics"


def test_client_keys_are_on_by_default_from_a_generated_secret(default):
    """The picker requires keys unless told otherwise: a generated Secret, kept across
    upgrades, mounted read-only as the picker's keys folder."""
    import base64

    secret = next(d for d in default if d["kind"] == "Secret" and d["metadata"]["name"]
                  .endswith("-api-keys"))
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(secret["data"]["default"]).decode()
    assert key.startswith("sk-sluice-") and len(key) >= 40
    picker = next(d for d in default if d["kind"] == "Deployment" and d["metadata"]["name"]
                  .endswith("-picker"))
    pod = picker["spec"]["template"]["spec"]
    assert "--api-keys-dir=/etc/sluice/api-keys" in pod["containers"][0]["args"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
    assert mount["readOnly"] and mount["mountPath"] == "/etc/sluice/api-keys"
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    own = render("picker.apiKeys.existingSecret=team-keys")
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-keys")
                   for d in own)
    opened = render("picker.apiKeys.enabled=false")
    picker = next(d for d in opened if d["kind"] == "Deployment" and d["metadata"]["name"]
                  .endswith("-picker"))
    assert not any("api-keys" in a for a in picker["spec"]["template"]["spec"]["containers"][0]
                   ["args"])


def test_network_policies_keep_engines_redis_and_picker_private(default, gie):
    policies = {d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"]
                for d in default if d["kind"] == "NetworkPolicy"}
    assert set(policies) == {"engines", "redis", "picker", "gateway", "operator", "keys"}
    # nothing reaches the operator or the CURVE keys hook (probes come from the node); Envoy's
    # listener from anywhere unless networkPolicy.clientsFrom says who
    assert "ingress" not in policies["operator"] and "ingress" not in policies["keys"]
    assert policies["gateway"]["ingress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]
    only = render("networkPolicy.clientsFrom[0].namespaceSelector.matchLabels.team=ingress")
    gateway = next(d["spec"] for d in only if d["kind"] == "NetworkPolicy"
                   and d["metadata"]["name"].endswith("-gateway"))
    assert gateway["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "ingress"}}}]

    def components(rule):
        return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for peer in rule["from"]}

    http, events, disaggregated = policies["engines"]["ingress"]
    assert disaggregated["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "sluice-engine", "sluice.dev/role": "decode"}}}]
    assert {p["port"] for p in disaggregated["ports"]} == {8000, labels.KV_TRANSFER_PORT}
    assert components(http) == {"gateway", "picker", "operator"}
    assert {p["port"] for p in http["ports"]} == {8000}
    assert components(events) == {"picker"}  # the prompts' token ids: the picker only
    assert {p["port"] for p in events["ports"]} == {5557, 5558}
    (redis,) = policies["redis"]["ingress"]
    assert components(redis) == {"picker", "operator"}
    ext_proc = policies["picker"]["ingress"][0]
    assert components(ext_proc) == {"gateway"} and ext_proc["ports"][0]["port"] == 9002
    # GIE mode: the chart's picker still serves only its Envoy; each pool's own picker
    # (sluice-epp pods, made by the operator) the Gateway's data plane only
    gie_policies = {d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"]
                    for d in gie if d["kind"] == "NetworkPolicy"}
    assert gie_policies["picker"]["ingress"] == policies["picker"]["ingress"]
    gateway = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": GATEWAY_NS}}}]
    epp = gie_policies["epp"]
    assert epp["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "sluice-epp"}}
    assert epp["ingress"][0] == {"from": gateway, "ports": [{"port": 9002, "protocol": "TCP"}]}
    epp_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "sluice-epp"}},
               "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sluice"}}}
    http, events, _, direct = gie_policies["engines"]["ingress"]
    assert epp_peer in http["from"] and epp_peer in events["from"]  # its scrapes and feeds
    assert epp_peer in gie_policies["redis"]["ingress"][0]["from"]
    # the Gateway's data plane connects to the engines directly
    assert direct == {"from": gateway, "ports": [{"port": 8000, "protocol": "TCP"}]}


def test_gie_mode_puts_no_engine_key_in_any_answer(gie):
    """GIE mode: any Gateway reads the picker's answers, so there is no engine key to carry
    (none rendered, none given to the picker or the operator); the engines admit only the
    Gateway's pods and the chart's own (the NetworkPolicy test above)."""
    assert not [m for m in gie if m["metadata"]["name"].endswith("-engine-key")]
    op = _by(gie, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert not [a for a in op["args"] if a.startswith("--engine-api-key-secret")]
    picker = _by(gie, "Deployment", "-picker")["spec"]["template"]["spec"]["containers"][0]
    assert "SLUICE_ENGINE_API_KEY" not in {e["name"] for e in picker["env"]}
    assert "SLUICE_ENGINE_API_KEY" not in {e["name"] for e in op["env"]}


def test_engines_get_a_key_only_the_picker_and_the_operator_hold(default):
    """The picker sends it with every request; the operator with the pools' LoRA adapter
    loads, the engines' only endpoints it calls that need it."""
    import base64

    secret = _by(default, "Secret", "-engine-key")
    assert base64.b64decode(secret["data"]["key"]).startswith(b"sk-engine-")
    op = _by(default, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert "--engine-api-key-secret=rel-sluice-engine-key:key" in op["args"]
    picker = _by(default, "Deployment", "-picker")["spec"]["template"]["spec"]["containers"][0]
    for container in (picker, op):
        env = {e["name"]: e for e in container["env"]}
        assert env["SLUICE_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "rel-sluice-engine-key", "key": "key"}
