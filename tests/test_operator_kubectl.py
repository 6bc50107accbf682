"""The real `kubectl` against the emulator with the operator running: apply the CRD and
a pool, see the printer columns, scale through the scale subresource, get rejected with
the schema's message, delete."""

from __future__ import annotations

import asyncio
import os
import pathlib
import tempfile

import kmock
from k8s_controllers import controllers
from k8s_harness import eventually, operator
from k8s_tools import tool
from kube_emulator import ApiServerEmulator

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _kubeconfig(server: kmock.Server, directory: str) -> dict[str, str]:
    path = pathlib.Path(directory, "config")
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: emu, cluster: {{server: "{str(server.url).rstrip('/')}"}}}}]
users: [{{name: tester, user: {{token: not-a-secret}}}}]
contexts: [{{name: emu, context: {{cluster: emu, user: tester, namespace: default}}}}]
current-context: emu
""")
    return {**os.environ, "KUBECONFIG": str(path), "KUBECACHEDIR": f"{directory}/cache"}


def test_kubectl_apply_get_scale_delete():
    kubectl = tool("kubectl")

    async def scenario():
        with tempfile.TemporaryDirectory() as tmp:
            async with ApiServerEmulator() as api, kmock.Server(api) as server:
                env = _kubeconfig(server, tmp)

                async def k(*args: str, ok: bool = True) -> str:
                    proc = await asyncio.create_subprocess_exec(
                        kubectl, *args, env=env, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE)
                    out, err = await asyncio.wait_for(proc.communicate(), 60)
                    assert (proc.returncode == 0) == ok, (args, out.decode(), err.decode())
                    return out.decode() + err.decode()

                out = await k("apply", "--validate=false", "-f",
                              str(ROOT / "crds/inferencepools.sluice.dev.yaml"))
                assert "inferencepools.sluice.dev created" in out
                async with operator(server), controllers(api):
                    await k("apply", "--validate=false", "-f",
                            str(ROOT / "charts/sluice/examples/pool-cpu.yaml"))
                    pool = lambda: api.store.get(api.kind("inferencepools"), "default",
                                                 "smollm2")
                    await eventually(lambda: pool().get("status", {}).get("readyReplicas") == 1,
                                     5, "ready")
                    table = await k("get", "inferencepools.sluice.dev")
                    header, row = table.strip().splitlines()[:2]
                    assert header.split() == ["NAME", "MODEL", "REPLICAS", "READY", "PREFILL",
                                              "DECODE", "KV-USAGE", "AGE"]
                    assert row.split()[:4] == ["smollm2", "smollm2-135m-instruct", "1", "1"]
                    # a prefill/decode pool shows each role's replicas
                    await k("apply", "--validate=false", "-f",
                            str(ROOT / "charts/sluice/examples/pool-disaggregated.yaml"))
                    pd_pool = lambda: api.store.get(api.kind("inferencepools"), "default",
                                                    "qwen3-pd")
                    await eventually(lambda: pd_pool().get("status", {}).get(
                        "readyReplicas") == 3, 10, "prefill/decode pool ready")
                    pd_row = (await k("get", "spool", "qwen3-pd")).strip().splitlines()[1]
                    assert pd_row.split()[:6] == ["qwen3-pd", "qwen3-0.6b", "3", "3", "1", "2"]
                    await k("delete", "spool/qwen3-pd", "--wait=true", "--timeout=20s")
                    wide = await k("get", "spool", "-o", "wide")
                    assert "AllReplicasReady" in wide and "Warning" not in wide

                    await k("scale", "inferencepools.sluice.dev/smollm2", "--replicas=2")
                    await eventually(lambda: api.store.get(
                        api.kind("deployments"), "default", "smollm2-serve")["spec"][
                        "replicas"] == 2, 5, "Deployment scaled by kubectl scale")

                    bad = pathlib.Path(tmp, "bad.yaml")
                    bad.write_text((ROOT / "charts/sluice/examples/pool-cpu.yaml").read_text()
                                   .replace("name: smollm2\n", "name: bad\n")
                                   .replace("  replicas: 1\n", "  replicas: 1\n  roles: "
                                            "{prefill: {}, decode: {}}\n"))
                    err = await k("apply", "--validate=false", "-f", str(bad), ok=False)
                    assert "set exactly one of spec.replicas" in err

                    await k("delete", "inferencepools.sluice.dev/smollm2", "--wait=true",
                            "--timeout=20s")
                    assert not api.store.list(api.kind("deployments"), "default")

    asyncio.run(asyncio.wait_for(scenario(), 120))
