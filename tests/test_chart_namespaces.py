"""One values key, `watchNamespaces`, feeds the operator and the gateway: the picker
discovers exactly the namespaces the operator serves, and what engines need in their
namespace (the engine key, their NetworkPolicy) is in each of them."""

from __future__ import annotations

import re

import pytest
from test_chart import CHART, helm, render

from sluice.cli import build_parser
from sluice.gateway.discovery.kubernetes import parse_namespaces
from sluice.operator.cli import config_from_args

SHAPES = {  # watchNamespaces -> (operator's namespaces, picker's namespaces)
    "": (("sluice",), ("sluice",)),  # empty: the release namespace
    "{team-a}": (("team-a",), ("team-a",)),
    "{team-a,team-b}": (("team-a", "team-b"), ("team-a", "team-b")),
    "{*}": ((), ("*",)),  # the operator cluster-wide; the picker lists every namespace
}


def _args(manifests: list[dict], name: str, container: int = 0, init: bool = False) -> list:
    pod = next(m for m in manifests if m["kind"] == "Deployment"
               and m["metadata"]["name"] == name)["spec"]["template"]["spec"]
    return pod["initContainers" if init else "containers"][container]["args"]


def _in(manifests: list[dict], kind: str, name: str) -> list[str]:
    return sorted(m["metadata"]["namespace"] for m in manifests
                  if m["kind"] == kind and m["metadata"]["name"] == name)


@pytest.mark.parametrize("value", list(SHAPES), ids=lambda v: v or "empty")
def test_operator_and_picker_serve_the_same_namespaces(value):
    manifests = render(f"watchNamespaces={value}") if value else render()
    operator_ns, picker_ns = SHAPES[value]
    args = _args(manifests, "rel-sluice-operator")
    config = config_from_args(build_parser(args).parse_args(args))
    assert config.namespaces == operator_ns and config.clusterwide == (operator_ns == ())
    config_map = next(m for m in manifests if m["kind"] == "ConfigMap"
                      and m["metadata"]["name"] == "rel-sluice-picker")["data"]
    picker = [re.sub(r"\$\((\w+)\)", lambda m: config_map[m.group(1)], a)  # the kubelet's
              for a in _args(manifests, "rel-sluice-picker")]
    parsed = build_parser(picker).parse_args(picker)
    assert parse_namespaces(parsed.namespace) == picker_ns
    served = [n for n in picker_ns if n != "*"]
    # the engines' key and NetworkPolicy where the engines run (the release's, for "*")
    assert _in(manifests, "Secret", "rel-sluice-engine-key") == sorted({"sluice", *served})
    assert _in(manifests, "NetworkPolicy", "rel-sluice-engines") == sorted(served or ["sluice"])
    peerings = {m["kind"] for m in manifests if m["kind"].endswith("KopfPeering")}
    assert peerings == ({"ClusterKopfPeering"} if not operator_ns else {"KopfPeering"})


@pytest.mark.parametrize("value", ["{team-a}", "{team-a,team-b}", "{*}"])
def test_envoy_learns_the_engines_from_the_picker_in_any_namespaces(value):
    """EDS from the picker, whatever the namespaces: no engines Service for Envoy to resolve,
    so the picker's fallbacks work across namespaces too."""
    manifests = render(f"watchNamespaces={value}")
    args = _args(manifests, "rel-sluice-gateway", init=True)
    assert "--eds" in args and not [a for a in args if a.startswith("--endpoints")]
    assert _in(manifests, "Service", "rel-sluice-engines") == []


def test_every_namespace_cannot_be_combined_with_others():
    out = helm("template", "rel", str(CHART), "--set", "watchNamespaces={*,team-a}")
    assert out.returncode != 0 and "cannot be combined" in out.stderr
    out = helm("template", "rel", str(CHART), "--set", "operator.watchNamespaces={a}")
    assert out.returncode != 0  # moved to the top-level key: refused, not ignored
