"""The operator image reconciles against the real kube-apiserver: `sluice operator` from
the image, read-only and as the chart's user, logged in with a kubeconfig, turns a pool
into its children and writes its status. Skipped without a Docker engine or the image
(`scripts/images.sh build`), like tests/test_images.py."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
import yaml
from test_images import USER, _docker, _engine_runs, _need

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_operator_image_reconciles_against_the_api_server(kube_controllers, kube_ns):
    plane, ns = kube_controllers, kube_ns
    if not _engine_runs():
        pytest.skip("no Docker engine answers (scripts/images.sh build starts one)")
    ref = _need("operator")
    kubeconfig = plane.admin_kubeconfig  # its CA is a path: mounted at the same place
    container = _docker(
        "run", "-d", "--read-only", "--cap-drop", "ALL", "--security-opt",
        "no-new-privileges", "--user", USER, "--tmpfs", "/tmp",
        # the API server listens on the host's loopback only
        "--network", "host",
        "-v", f"{kubeconfig}:/etc/sluice/kubeconfig:ro",
        "-v", f"{plane.ca_file}:{plane.ca_file}:ro",
        "-e", "KUBECONFIG=/etc/sluice/kubeconfig", ref,
        "operator", "--standalone", f"--namespace={ns}", "--liveness=").stdout.strip()
    try:
        pool = yaml.safe_load((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text())
        plane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pool))
        deadline, status = time.monotonic() + 60, {}
        while time.monotonic() < deadline and not status.get("conditions"):
            time.sleep(0.5)
            status = json.loads(plane.kubectl("get", "-n", ns, "inferencepools.sluice.dev",
                                              "smollm2", "-o", "json").stdout).get("status", {})
        logs = _docker("logs", container, check=False)
        assert status.get("conditions"), logs.stdout[-2000:] + logs.stderr[-2000:]
        dep = json.loads(plane.kubectl("get", "-n", ns, "deployment", "smollm2-serve",
                                       "-o", "json", "--show-managed-fields").stdout)
        managers = {m["manager"] for m in dep["metadata"]["managedFields"]}
        assert "sluice-operator" in managers
    finally:
        _docker("rm", "-f", container, check=False)
