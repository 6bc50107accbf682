"""checkov's Kubernetes checks for the chart's security defaults (issue 20), written out.

checkov pins old versions of packages the engine's torch imports (networkx, packaging), so it
cannot share the test environment; these are its checks, by their ids, run on the chart's
renders (default, custom values, GIE, HTTPS) and on the engine Deployments the chart's operator
renders for every example pool. A workload may skip a check the way checkov reads skips (an
annotation `checkov.io/skipN: ID=reason`, written by the chart's `sluice.checkovSkips`), with a
reason, and only a check in SKIPPABLE; a skip in the default render that no check needs fails,
so none outlives its reason. With checkov installed (SLUICE_CHECKOV=path, or `checkov` on
PATH) `test_checkov_itself_agrees` runs the real one over the same manifests."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Callable

import pytest
import yaml
from test_chart import CHART, GIE, NON_DEFAULT, render
from test_chart_gateway_tls import CERT_MANAGER

from sluice.operator import cli as operator_cli
from sluice.operator.render import render_pool
from sluice.operator.spec import PoolSpec

WORKLOADS = ("Deployment", "StatefulSet", "Job")
RENDERS = {"default": [], "custom": NON_DEFAULT, "gie": GIE, "tls": CERT_MANAGER}
POOLS = ("pool-cpu.yaml", "pool-vllm-gpu.yaml", "pool-disaggregated.yaml")
# What a workload may skip, with a reason. Never: root, privilege, capabilities, a writable
# root filesystem, seccomp, memory requests or limits, a pod no NetworkPolicy selects.
SKIPPABLE = {"CKV_K8S_9", "CKV_K8S_11", "CKV_K8S_15", "CKV_K8S_35", "CKV_K8S_38", "CKV_K8S_43"}
# The operator's engine Deployments carry no skip annotations; what they are allowed instead:
ENGINE_ACCEPTED = {
    "CKV_K8S_11": "no CPU limit unless the pool sets one (CFS throttling stalls decoding)",
    "CKV_K8S_15": "pinned image tags, IfNotPresent",
    "CKV_K8S_35": "VLLM_API_KEY and HF_TOKEN by secretKeyRef: vLLM reads its key from the "
                  "environment only",
    "CKV_K8S_43": "pinned image tags (the pool's engine.image may give a digest)",
}
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY)", re.IGNORECASE)


def _pod(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def _containers(w: dict) -> list[dict]:
    pod = _pod(w)
    return pod["containers"] + pod.get("initContainers", [])


def _security(w: dict, c: dict, key: str):
    """A container's setting, else the pod's (as Kubernetes resolves them)."""
    return c.get("securityContext", {}).get(key, _pod(w).get("securityContext", {}).get(key))


def _resources(kind: str, resource: str) -> Callable[[dict, list], bool]:
    return lambda w, _: all(c.get("resources", {}).get(kind, {}).get(resource)
                            for c in _pod(w)["containers"])


def _selected(w: dict, policies: list[dict]) -> bool:
    labels = w["spec"]["template"]["metadata"]["labels"]
    return any(p["metadata"]["namespace"] == w["metadata"]["namespace"]
               and p["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items()
               for p in policies)


def _no_literal_secrets(w: dict, _) -> bool:
    """Issue 20: a token, password or key only from a Secret reference."""
    return not any(SECRET_NAME.search(e["name"]) and "value" in e
                   for c in _containers(w) for e in c.get("env", []))


# id -> passes(workload, NetworkPolicies)
CHECKS: dict[str, Callable[[dict, list], bool]] = {
    "CKV_K8S_8": lambda w, _: w["kind"] == "Job" or all(
        "livenessProbe" in c for c in _pod(w)["containers"]),
    "CKV_K8S_9": lambda w, _: w["kind"] == "Job" or all(
        "readinessProbe" in c for c in _pod(w)["containers"]),
    "CKV_K8S_10": _resources("requests", "cpu"),
    "CKV_K8S_11": _resources("limits", "cpu"),
    "CKV_K8S_12": _resources("requests", "memory"),
    "CKV_K8S_13": _resources("limits", "memory"),
    "CKV_K8S_14": lambda w, _: all(
        ":" in c["image"].rsplit("/", 1)[-1] and not c["image"].endswith(":latest")
        for c in _containers(w)),
    "CKV_K8S_15": lambda w, _: all(c.get("imagePullPolicy") == "Always"
                                   for c in _containers(w)),
    "CKV_K8S_16": lambda w, _: not any(_security(w, c, "privileged") for c in _containers(w)),
    "CKV_K8S_17": lambda w, _: not _pod(w).get("hostPID"),
    "CKV_K8S_18": lambda w, _: not _pod(w).get("hostIPC"),
    "CKV_K8S_19": lambda w, _: not _pod(w).get("hostNetwork"),
    "CKV_K8S_20": lambda w, _: all(_security(w, c, "allowPrivilegeEscalation") is False
                                   for c in _containers(w)),
    "CKV_K8S_22": lambda w, _: all(_security(w, c, "readOnlyRootFilesystem") is True
                                   for c in _containers(w)),
    "CKV_K8S_23": lambda w, _: all(_security(w, c, "runAsNonRoot") is True
                                   for c in _containers(w)),
    "CKV_K8S_28": lambda w, _: all({"ALL", "NET_RAW"} & set(
        (_security(w, c, "capabilities") or {}).get("drop", [])) for c in _containers(w)),
    "CKV_K8S_31": lambda w, _: all((_security(w, c, "seccompProfile") or {}).get("type")
                                   == "RuntimeDefault" for c in _containers(w)),
    "CKV_K8S_35": lambda w, _: not any(
        "secretKeyRef" in e.get("valueFrom", {}) for c in _containers(w)
        for e in c.get("env", [])) and not any(
        "secretRef" in f for c in _containers(w) for f in c.get("envFrom", [])),
    "CKV_K8S_37": lambda w, _: all(
        "ALL" in (_security(w, c, "capabilities") or {}).get("drop", [])
        and not (_security(w, c, "capabilities") or {}).get("add") for c in _containers(w)),
    "CKV_K8S_38": lambda w, _: _pod(w).get("automountServiceAccountToken") is False,
    "CKV_K8S_40": lambda w, _: all((_security(w, c, "runAsUser") or 0) >= 10000
                                   for c in _containers(w)),
    "CKV_K8S_43": lambda w, _: all("@sha256:" in c["image"] for c in _containers(w)),
    "CKV2_K8S_6": lambda w, policies: _selected(w, policies),
    "literal-secret-env": _no_literal_secrets,
}


def skips(w: dict) -> dict[str, str]:
    """The workload's skips as checkov reads them: `checkov.io/skipN: ID=reason`, split on
    '=' into exactly two parts (a reason holding '=' crashes checkov)."""
    out = {}
    for key, value in w["metadata"].get("annotations", {}).items():
        if key.startswith("checkov.io/skip"):
            parts = value.split("=")
            assert len(parts) == 2, (w["metadata"]["name"], value)
            out[parts[0]] = parts[1]
    return out


def engine_deployments(manifests: list[dict]) -> list[dict]:
    """Every example pool's engine Deployments, rendered with the chart's operator flags in
    the namespace the chart routes (where its engines' NetworkPolicy is)."""
    op = next(m for m in manifests if m["kind"] == "Deployment"
              and m["metadata"]["name"].endswith("-operator"))
    parser = argparse.ArgumentParser()
    operator_cli.add_arguments(parser)
    args = parser.parse_args(_pod(op)["containers"][0]["args"][1:])
    config = operator_cli.config_from_args(args).render
    engines_policy = [m for m in manifests if m["kind"] == "NetworkPolicy"
                      and m["metadata"]["name"].endswith("-engines")]
    namespace = (engines_policy[0]["metadata"]["namespace"] if engines_policy
                 else op["metadata"]["namespace"])
    out = []
    for name in POOLS:
        body = yaml.safe_load((CHART / "examples" / name).read_text())
        body["metadata"].update(namespace=namespace, uid="u-1")
        out += [m for m in render_pool(PoolSpec.from_body(body), config)
                if m["kind"] == "Deployment"]
    return out


def findings(manifests: list[dict]) -> list[tuple[str, str, str]]:
    """(workload, check id, verdict) for every check a workload fails: 'skipped' with a
    reason, 'accepted' (an engine, ENGINE_ACCEPTED), else 'FAILED'."""
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    out = []
    for w in [m for m in manifests if m["kind"] in WORKLOADS] + engine_deployments(manifests):
        skipped = skips(w)
        engine = w["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == \
            "sluice-operator"
        for check_id, passes in CHECKS.items():
            if passes(w, policies):
                continue
            if skipped.get(check_id) and check_id in SKIPPABLE:
                verdict = "skipped"
            elif engine and check_id in ENGINE_ACCEPTED:
                verdict = "accepted"
            else:
                verdict = "FAILED"
            out.append((w["metadata"]["name"], check_id, verdict))
    return out


@pytest.fixture(scope="module", params=list(RENDERS))
def rendered(request):
    return request.param, render(*RENDERS[request.param])


def test_no_check_fails_that_is_not_skipped_with_a_reason(rendered):
    _, manifests = rendered
    failed = [f for f in findings(manifests) if f[2] == "FAILED"]
    assert failed == []
    for w in (m for m in manifests if m["kind"] in WORKLOADS):
        for check_id, reason in skips(w).items():
            assert check_id in SKIPPABLE and len(reason) > 20, (w["metadata"]["name"], check_id)


def test_every_skip_in_the_default_render_is_needed():
    manifests = render()
    needed = {(name, check_id) for name, check_id, verdict in findings(manifests)
              if verdict == "skipped"}
    declared = {(w["metadata"]["name"], check_id) for w in manifests
                if w["kind"] in WORKLOADS for check_id in skips(w)}
    assert declared == needed


def test_the_checks_catch_what_they_are_for():
    """Each check fails the workload it is written against (the checks can fail)."""
    manifests = render()
    picker = next(m for m in manifests if m["kind"] == "Deployment"
                  and m["metadata"]["name"].endswith("-picker"))
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    bad = yaml.safe_load(yaml.safe_dump(picker))
    pod = _pod(bad)
    c = pod["containers"][0]
    c["securityContext"].update(readOnlyRootFilesystem=False, allowPrivilegeEscalation=True,
                                capabilities={"add": ["NET_ADMIN"]})
    pod["securityContext"].update(runAsUser=0, runAsNonRoot=False)
    pod["securityContext"].pop("seccompProfile")
    c["resources"]["limits"].pop("memory")
    c["env"].append({"name": "HF_TOKEN", "value": "hf_literal"})
    bad["spec"]["template"]["metadata"]["labels"] = {"app": "unselected"}
    failing = {i for i, passes in CHECKS.items() if not passes(bad, policies)}
    assert {"CKV_K8S_22", "CKV_K8S_20", "CKV_K8S_37", "CKV_K8S_28", "CKV_K8S_23",
            "CKV_K8S_40", "CKV_K8S_31", "CKV_K8S_13", "literal-secret-env",
            "CKV2_K8S_6"} <= failing
    assert not {"CKV_K8S_22", "CKV_K8S_40", "CKV2_K8S_6"} & {
        i for i, passes in CHECKS.items() if not passes(picker, policies)}


def test_engine_and_redis_pods_carry_no_api_token():
    manifests = render()
    for w in [m for m in manifests if m["kind"] == "StatefulSet"] + \
            engine_deployments(manifests):
        assert CHECKS["CKV_K8S_38"](w, []), w["metadata"]["name"]


def _checkov() -> str | None:
    return os.environ.get("SLUICE_CHECKOV") or shutil.which("checkov")


@pytest.mark.slow
@pytest.mark.skipif(_checkov() is None, reason="checkov not installed (SLUICE_CHECKOV=path)")
def test_checkov_itself_agrees(tmp_path: pathlib.Path):
    """The real checkov over the default render and the engines: only the engines' accepted
    checks fail (they carry no skip annotations)."""
    manifests = render()
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(manifests + engine_deployments(manifests)))
    out = subprocess.run([str(_checkov()), "-f", str(path), "--framework", "kubernetes",
                          "--quiet", "--compact", "-o", "json", "--skip-download"],
                         capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(out.stdout)
    failed = report["results"]["failed_checks"] if report else []
    engines = {m["metadata"]["name"] for m in engine_deployments(manifests)}
    unexpected = [(f["check_id"], f["resource"]) for f in failed
                  if f["resource"].split(".")[2] not in engines
                  or f["check_id"] not in ENGINE_ACCEPTED]
    assert unexpected == []
    assert report["summary"]["skipped"] > 0  # the chart's annotations were read
