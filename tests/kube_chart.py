"""The Helm chart on the tests' real API server (`kube_api.ControlPlane`): render it, have
the server judge what it renders (server-side dry-run), install the parts a test runs with
(ServiceAccounts, RBAC, peering objects), log in with its ServiceAccounts' tokens, and read
from the audit log what each of them asked and what the authorizer answered."""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import secrets
import subprocess
from collections.abc import Iterable, Iterator
from typing import Any

import yaml
from k8s_tools import tool
from kube_api import ControlPlane

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sluice"
CHART_CRDS = sorted((CHART / "crds").glob("*.yaml"))
GIE_CRD = ROOT / "tests" / "crds" / "gie" / "inference.networking.k8s.io_inferencepools.yaml"
RBAC_KINDS = ("ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")
PEERING_KINDS = ("KopfPeering", "ClusterKopfPeering")
HOOK = "helm.sh/hook"


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=120,
                          check=False)


def render(*sets: str, release: str = "rel", namespace: str = "sluice") -> list[dict]:
    """`helm template` of the chart with `--set` values: its manifests."""
    flags = [f for s in sets for f in ("--set", s)]
    out = helm("template", release, str(CHART), "--namespace", namespace, *flags)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def unique_release() -> str:
    """A release name of a test's own: the chart's cluster-scoped objects (ClusterRoles,
    ClusterKopfPeering) carry it, and the session's tests share one API server."""
    return f"r{secrets.token_hex(3)}"


def is_hook(manifest: dict) -> bool:
    return HOOK in (manifest["metadata"].get("annotations") or {})


def to_yaml(manifests: Iterable[dict]) -> str:
    return yaml.safe_dump_all(list(manifests), sort_keys=False)


def apply(plane: ControlPlane, manifests: Iterable[dict], *, dry_run: bool = False,
          kubeconfig: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    """`kubectl apply --server-side` (strict field validation: unknown fields are errors);
    `dry_run`: the server's whole admission and validation, nothing stored."""
    args = ["apply", "--server-side", "--force-conflicts", "-f", "-"]
    if dry_run:
        args.insert(1, "--dry-run=server")
    return plane.kubectl(*args, kubeconfig=kubeconfig, input=to_yaml(manifests))


def server_errors(plane: ControlPlane, manifests: list[dict]) -> str:
    """What the real API server refuses of `manifests` (server-side dry-run), '' when
    nothing. Their namespaces must exist."""
    done = plane.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-",
                         input=to_yaml(manifests), check=False)
    return "" if done.returncode == 0 else done.stderr.strip()


def install_crds(plane: ControlPlane, *paths: pathlib.Path) -> None:
    """Apply CRD files (idempotent) and wait until their types are served."""
    names = []
    for path in paths:
        plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        names += [f"crd/{d['metadata']['name']}" for d in yaml.safe_load_all(path.read_text())
                  if d]
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)
    plane.forget_discovery()


@contextlib.contextmanager
def namespace(plane: ControlPlane, prefix: str) -> Iterator[str]:
    """A fresh namespace, deleted (with what is in it) afterwards."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    plane.create_namespace(name)
    try:
        yield name
    finally:
        plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextlib.contextmanager
def installed(plane: ControlPlane, manifests: list[dict]) -> Iterator[list[dict]]:
    """`manifests` created for real (as the admin); the cluster-scoped ones deleted after
    (the namespaced ones go with their namespaces)."""
    apply(plane, manifests)
    try:
        yield manifests
    finally:
        for m in manifests:
            if "namespace" not in m["metadata"]:
                plane.kubectl("delete", m["kind"].lower(), m["metadata"]["name"],
                              "--wait=false", "--ignore-not-found", check=False)


def pick(manifests: list[dict], kinds: Iterable[str], hooks: bool = False) -> list[dict]:
    """The manifests of these kinds (the Helm hooks' only when `hooks`)."""
    kinds = tuple(kinds)
    return [m for m in manifests if m["kind"] in kinds and is_hook(m) == hooks]


def service_account(manifests: list[dict], suffix: str) -> tuple[str, str]:
    """(namespace, name) of the chart's ServiceAccount named ...`suffix`."""
    (sa,) = [m for m in manifests if m["kind"] == "ServiceAccount" and not is_hook(m)
             and m["metadata"]["name"].endswith(suffix)]
    return sa["metadata"]["namespace"], sa["metadata"]["name"]


def username(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


def login(plane: ControlPlane, namespace: str, name: str) -> tuple[str, pathlib.Path]:
    """A token of that ServiceAccount (as the kubelet projects it) and a kubeconfig with it."""
    token = plane.token_for(namespace, name)
    return token, plane.kubeconfig(token, f"{namespace}-{name}")


def requests_by(plane: ControlPlane, user: str) -> list[dict[str, Any]]:
    """Every request `user` made so far (audit events)."""
    return [e for e in plane.audit() if e.get("user", {}).get("username") == user]


def denied(events: list[dict[str, Any]]) -> list[str]:
    """The requests the RBAC authorizer refused, as 'VERB URI'. (Not every 403: admission
    refuses writes into a namespace being deleted with one too, e.g. another test's.)"""
    return [f"{e['verb']} {e['requestURI']}" for e in events
            if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"]


def made(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(verb, API group, resource[/subresource]) of the resource requests among `events`."""
    out = set()
    for e in events:
        ref = e.get("objectRef")
        if ref and ref.get("resource"):
            resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource")
                                          else "")
            out.add((e["verb"], ref.get("apiGroup", ""), resource))
    return out


def operator_config(manifests: list[dict]) -> dict[str, Any]:
    """The OperatorConfig fields the chart's operator Deployment gives it by its flags (what
    it renders, which namespaces, peering, GIE), for `k8s_harness.operator(**fields)`."""
    from sluice.operator import cli

    (dep,) = [m for m in manifests if m["kind"] == "Deployment"
              and m["metadata"]["name"].endswith("-operator")]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = cli.config_from_args(parser.parse_args(args[1:]))
    return {"render": config.render, "namespaces": config.namespaces,
            "peering_name": config.peering_name, "gie": config.gie}
