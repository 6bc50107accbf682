"""The real `kubectl` against a real API server with the operator running: apply the CRD
and a pool, see the printer columns, scale through the scale subresource, get rejected
with the schema's message, delete."""

from __future__ import annotations

import asyncio
import pathlib

from k8s_harness import View, client, eventually, operator
from k8s_kubelet import kubelet

from sluice.operator import kube

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts/sluice/examples"


def test_kubectl_apply_get_scale_delete(kube_controllers, kube_ns, tmp_path):
    plane, ns = kube_controllers, kube_ns

    async def k(*args: str, ok: bool = True) -> str:
        done = await asyncio.to_thread(plane.kubectl, *args, "-n", ns, check=False)
        assert (done.returncode == 0) == ok, (args, done.stdout, done.stderr)
        return done.stdout + done.stderr

    async def scenario():
        # (the session's server has the CRD: applying it again is what an upgrade does)
        out = await k("apply", "--server-side", "-f",
                      str(ROOT / "crds/inferencepools.sluice.dev.yaml"))
        assert "inferencepools.sluice.dev serverside-applied" in out
        async with (client(plane.admin_kubeconfig) as api, operator(plane, namespaces=(ns,)),
                    kubelet(api, ns)):
            view = View(api, ns)
            await k("apply", "-f", str(EXAMPLES / "pool-cpu.yaml"))
            await eventually(lambda: _ready(view, "smollm2", 1), 30, "ready")
            table = await k("get", "inferencepools.sluice.dev")
            header, row = table.strip().splitlines()[:2]
            assert header.split() == ["NAME", "MODEL", "REPLICAS", "READY", "PREFILL",
                                      "DECODE", "KV-USAGE", "AGE"]
            assert row.split()[:4] == ["smollm2", "smollm2-135m-instruct", "1", "1"]
            # a prefill/decode pool shows each role's replicas
            await k("apply", "-f", str(EXAMPLES / "pool-disaggregated.yaml"))
            await eventually(lambda: _ready(view, "qwen3-pd", 3), 30, "prefill/decode pool ready")
            pd_row = (await k("get", "spool", "qwen3-pd")).strip().splitlines()[1]
            assert pd_row.split()[:6] == ["qwen3-pd", "qwen3-0.6b", "3", "3", "1", "2"]
            await k("delete", "spool/qwen3-pd", "--wait=true", "--timeout=60s")
            wide = await k("get", "spool", "-o", "wide")
            assert "AllReplicasReady" in wide and "Warning" not in wide

            await k("scale", "inferencepools.sluice.dev/smollm2", "--replicas=2")

            async def scaled() -> bool:
                dep = await api.get(kube.DEPLOYMENTS, ns, "smollm2-serve")
                return dep["spec"]["replicas"] == 2
            await eventually(scaled, 30, "Deployment scaled by kubectl scale")

            bad = tmp_path / "bad.yaml"
            bad.write_text((EXAMPLES / "pool-cpu.yaml").read_text()
                           .replace("name: smollm2\n", "name: bad\n")
                           .replace("  replicas: 1\n", "  replicas: 1\n  roles: "
                                    "{prefill: {}, decode: {}}\n"))
            err = await k("apply", "-f", str(bad), ok=False)
            assert "set exactly one of spec.replicas" in err

            await k("delete", "inferencepools.sluice.dev/smollm2", "--wait=true",
                    "--timeout=60s")
            # its children go with it (kube-controller-manager's garbage collector)
            await eventually(lambda: _none_left(view), 60, "children removed")

    asyncio.run(asyncio.wait_for(scenario(), 240))


async def _ready(view: View, name: str, n: int) -> bool:
    pool = await view.get(kube.POOLS, name)
    return (pool.get("status") or {}).get("readyReplicas") == n


async def _none_left(view: View) -> bool:
    return not await view.names(kube.DEPLOYMENTS)
