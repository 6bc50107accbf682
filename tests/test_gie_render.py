"""GIE mode, pure parts: the GIE `InferencePool` the operator renders per sluice pool (valid
against GIE's v1 schema, selecting exactly the pool's engine pods on their serving port), the
operator flags that turn it on, and the chart's example HTTPRoute that routes to it."""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import pytest
import yaml

from sluice import labels
from sluice.cli import build_parser
from sluice.operator.cli import config_from_args
from sluice.operator.render import render_pool, spec_hash
from sluice.operator.render_epp import epp_name, render_epp
from sluice.operator.render_gie import GieConfig, render_gie_pool
from sluice.operator.spec import PoolSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts" / "sluice" / "examples"
SCHEMAS = ROOT / "tests" / "schemas"
POOLS = ("pool-cpu.yaml", "pool-vllm-gpu.yaml", "pool-disaggregated.yaml")
GIE = GieConfig(picker_service="rel-sluice-picker")


def schema_validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def gie_errors(obj: dict) -> list[str]:
    """GIE v1 schema violations of `obj`, as 'path: message' (empty: valid)."""
    validator = schema_validator("gie-inferencepool-v1.json")
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


def _pool(name: str) -> PoolSpec:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body["metadata"].update(uid="uid-1", namespace="sluice")
    return PoolSpec.from_body(body)


@pytest.mark.parametrize("name", POOLS)
def test_gie_pool_is_valid_and_selects_exactly_the_engine_pods(name):
    pool = _pool(name)
    gie = render_gie_pool(pool, GIE)
    assert gie_errors(gie) == []
    assert (gie["apiVersion"], gie["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert gie["metadata"]["name"] == pool.name and gie["metadata"]["namespace"] == "sluice"
    selector = gie["spec"]["selector"]["matchLabels"]
    deployments = [m for m in render_pool(pool) if m["kind"] == "Deployment"]
    for dep in deployments:  # every role's pods (prefill and decode too), on their http port
        pod = dep["spec"]["template"]
        assert selector.items() <= pod["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert gie["spec"]["targetPorts"] == [{"number": ports["http"]}]
    # nothing but this pool's engines: another pool's pods do not match
    other = render_pool(_pool("pool-cpu.yaml") if pool.name != "smollm2" else
                        _pool("pool-disaggregated.yaml"))
    other_pod = next(m for m in other if m["kind"] == "Deployment")["spec"]["template"]
    assert not selector.items() <= other_pod["metadata"]["labels"].items()
    # the same pods as the pool's own headless Service (what the picker discovers)
    service = next(m for m in render_pool(pool) if m["kind"] == "Service")
    assert selector == service["spec"]["selector"]


def test_gie_pool_names_the_picker_and_is_an_owned_child():
    gie = render_gie_pool(_pool("pool-cpu.yaml"), GieConfig("picker", 9102, "FailOpen"))
    assert gie["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "picker", "port": {"number": 9102},
        "failureMode": "FailOpen"}
    assert gie["metadata"]["ownerReferences"] == [{
        "apiVersion": "sluice.dev/v1alpha1", "kind": "InferencePool", "name": "smollm2",
        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert gie["metadata"]["labels"] == labels.common_labels("smollm2")
    assert gie["metadata"]["annotations"][labels.SPEC_HASH_ANNOTATION] == spec_hash(gie)
    default = render_gie_pool(_pool("pool-cpu.yaml"), GIE)["spec"]["endpointPickerRef"]
    assert default["port"] == {"number": 9002} and default["failureMode"] == "FailClose"


def test_rendering_is_pure():
    assert render_gie_pool(_pool("pool-cpu.yaml"), GIE) == render_gie_pool(
        _pool("pool-cpu.yaml"), GIE)


@pytest.mark.parametrize("break_it,where", [
    (lambda s: s["targetPorts"].append({"number": 8001}), "targetPorts"),
    (lambda s: s["targetPorts"][0].update(number=70000), "targetPorts.0.number"),
    (lambda s: s["endpointPickerRef"].pop("port"), "endpointPickerRef"),
    (lambda s: s["endpointPickerRef"].update(failureMode="Retry"), "failureMode"),
    (lambda s: s["endpointPickerRef"].pop("name"), "endpointPickerRef"),
    (lambda s: s["selector"].update(matchLabels={}), "matchLabels"),
    (lambda s: s["selector"]["matchLabels"].update({"bad key!": "x"}), "matchLabels"),
    (lambda s: s.pop("selector"), "spec"),
])
def test_gie_schema_is_not_vacuous(break_it, where):
    gie = copy.deepcopy(render_gie_pool(_pool("pool-cpu.yaml"), GIE))
    break_it(gie["spec"])
    errors = gie_errors(gie)
    assert errors and any(where in e for e in errors), errors


def test_port_may_be_omitted_only_for_a_non_service_picker():
    gie = copy.deepcopy(render_gie_pool(_pool("pool-cpu.yaml"), GIE))
    ref = gie["spec"]["endpointPickerRef"]
    ref.pop("port")
    ref.pop("kind")  # kind defaults to Service: the port is still required
    assert gie_errors(gie)
    ref.update(group="example.com", kind="Picker")
    assert gie_errors(gie) == []


def test_operator_flags_turn_gie_mode_on():
    argv = ["operator", "--gie-endpoint-picker", "rel-sluice-picker", "--gie-namespace",
            "sluice", "--gie-failure-mode", "FailOpen", "--gie-endpoint-picker-port", "9102"]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert config.gie == GieConfig("rel-sluice-picker", 9102, "FailOpen", "sluice")
    assert config.gie.applies_to("sluice") and not config.gie.applies_to("team-a")
    off = config_from_args(build_parser(["operator"]).parse_args(["operator"]))
    assert off.gie is None
    assert GieConfig("p").applies_to("any-namespace")


def test_operator_gie_env_turns_it_on(monkeypatch):
    monkeypatch.setenv("SLUICE_GIE_ENDPOINT_PICKER", "picker")
    config = config_from_args(build_parser(["operator"]).parse_args(["operator"]))
    assert config.gie == GieConfig("picker")


@pytest.mark.parametrize("kwargs", [{"picker_service": ""},
                                    {"picker_service": "p", "failure_mode": "Never"},
                                    {"picker_service": "p", "picker_port": 0}])
def test_gie_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        GieConfig(**kwargs)


def test_example_httproute_targets_the_gie_pool_of_the_example_pool():
    route = yaml.safe_load((EXAMPLES / "httproute-gie.yaml").read_text())
    validator = schema_validator("gateway-httproute-v1.json")
    assert [e.message for e in validator.iter_errors(route)] == []
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    gie = render_gie_pool(_pool("pool-cpu.yaml"), GIE)
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", gie["kind"], gie["metadata"]["name"])
    assert "port" not in backend  # an InferencePool's port is its targetPorts
    # the route's shape checks bite: a Service backend without a port, a pool with one
    for bad in ({"name": "svc"}, {**backend, "port": 8000},
                {**backend, "group": "sluice.dev"}):
        broken = copy.deepcopy(route)
        broken["spec"]["rules"][0]["backendRefs"] = [bad]
        assert list(validator.iter_errors(broken)), bad


def _template(args: list[str]) -> dict:
    return {"metadata": {"name": "rel-sluice-picker"}, "spec": {"replicas": 2, "template": {
        "metadata": {"labels": {"app.kubernetes.io/component": "picker"},
                     "annotations": {"checksum": "x"}},
        "spec": {"serviceAccountName": "rel-sluice-picker", "containers": [
            {"name": "picker", "image": "sluice-gateway:1", "args": args}]}}}}


def test_each_pool_gets_the_charts_picker_scoped_to_it():
    pool = _pool("pool-cpu.yaml")
    args = ["epp", "--discovery=kubernetes", "--namespace=$(NS)", "--pool=x",
            "--secure-serving", "--grpc-health-port=9003"]
    deployment, service = render_epp(pool, _template(args))
    spec = deployment["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    assert container["args"] == [
        "epp", "--discovery=kubernetes", "--secure-serving", "--grpc-health-port=9003",
        f"--pool-name={pool.name}", "--pool-namespace=sluice",
        "--pool-group=inference.networking.k8s.io"]
    assert container["image"] == "sluice-gateway:1" and spec["replicas"] == 2
    assert spec["template"]["spec"]["serviceAccountName"] == "rel-sluice-picker"
    # pods of its own: neither the chart's picker Services nor the engines' selectors
    pod_labels = spec["template"]["metadata"]["labels"]
    assert pod_labels == {"app.kubernetes.io/name": "sluice-epp",
                          "sluice.dev/epp-pool": pool.name}
    assert spec["selector"]["matchLabels"] == pod_labels == service["spec"]["selector"]
    assert labels.POOL not in pod_labels and labels.MANAGED_BY not in pod_labels
    for child in (deployment, service):  # owned (pruned, collected) like the pool's others
        assert child["metadata"]["name"] == epp_name(pool.name)
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert child["metadata"]["labels"][labels.POOL] == pool.name
    assert service["spec"]["ports"][0]["appProtocol"] == "https"  # it serves TLS
    plain = render_epp(pool, _template(["epp"]))[1]
    assert plain["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    gie = render_gie_pool(pool, GieConfig("rel-sluice-picker"), epp_name(pool.name))
    assert gie["spec"]["endpointPickerRef"]["name"] == epp_name(pool.name)
    broken = _template([])
    broken["spec"]["template"]["spec"]["containers"][0]["name"] = "other"
    with pytest.raises(ValueError, match="no 'picker' container"):
        render_epp(pool, broken)
