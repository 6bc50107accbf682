"""What a user does with the one-node cluster, checked step by step: the chart installed
from the local images, `pool-cpu.yaml` applied and Ready, chat completions through the
chart's Envoy Service, a repeated prefix kept on one pod, a killed engine replaced while
requests keep being answered, the autoscaler following KV-cache usage up and down, the
pool deleted with its children, `helm uninstall` leaving nothing behind; then the same
chart in GIE mode, with GIE's own CRD, its InferencePool accepted and routed through."""

from __future__ import annotations

import base64
import contextlib
import json
import pathlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
NS = "sluice"
POOL = "smollm2"
MODEL = "smollm2-135m-instruct"
# The chart's images by local name; Envoy's own image is not reachable: the gateway image
# carries the same Envoy release at the path the chart runs.
VALUES = {
    "operator.image.repository": "local/sluice-operator", "operator.image.tag": "dev",
    "operator.image.pullPolicy": "Never", "operator.engineImage": "local/sluice-engine:dev",
    "picker.image.repository": "local/sluice-gateway", "picker.image.tag": "dev",
    "picker.image.pullPolicy": "Never",
    "envoy.image.repository": "local/sluice-gateway", "envoy.image.tag": "dev",
    "envoy.image.pullPolicy": "Never",
    "redis.image.repository": "local/redis", "redis.image.tag": "e2e",
    "redis.image.pullPolicy": "Never",
    # one node of 2 CPUs: one replica of each, and engines that fit twice
    "operator.replicas": "1", "picker.replicas": "1", "envoy.replicas": "1",
}


class Cluster:
    def __init__(self, kubeconfig: pathlib.Path):
        import sys

        sys.path.insert(0, str(ROOT / "tests"))
        from k8s_tools import tool

        self.kubeconfig = kubeconfig
        self.kubectl_bin, self.helm_bin = tool("kubectl"), tool("helm")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self._run([self.kubectl_bin, *args], input, check)

    def helm(self, *args: str, check: bool = True) -> str:
        return self._run([self.helm_bin, *args], None, check)

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def _run(self, argv: list[str], input: str | None, check: bool) -> str:
        done = subprocess.run([*argv, f"--kubeconfig={self.kubeconfig}"], input=input,
                              text=True, capture_output=True, check=False)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(argv[:3])}…: {done.stderr.strip()[-2000:]}")
        return done.stdout

    @contextlib.contextmanager
    def port_forward(self, target: str, port: int) -> Iterator[str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            local = s.getsockname()[1]
        proc = subprocess.Popen([self.kubectl_bin, f"--kubeconfig={self.kubeconfig}",
                                 "port-forward", "-n", NS, target, f"{local}:{port}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:… -> …"
            assert "Forwarding from" in line, line
            yield f"http://127.0.0.1:{local}"
        finally:
            proc.terminate()
            proc.wait(10)


def eventually(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except (RuntimeError, httpx.HTTPError, AssertionError, KeyError) as e:
            last = e
        time.sleep(2)
    raise AssertionError(f"not within {timeout} s: {what} (last: {last!r})")


def step(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            t0 = time.monotonic()
            print(f"--> {name}", flush=True)
            result = fn(*args)
            print(f"    ok in {time.monotonic() - t0:.0f} s", flush=True)
            return result
        return run
    return wrap


@step("helm install charts/sluice with the local images")
def install(c: Cluster, extra: dict[str, str] | None = None) -> None:
    values = [f"--set={k}={v}" for k, v in {**VALUES, **(extra or {})}.items()]
    c.helm("upgrade", "--install", "sluice", str(ROOT / "charts" / "sluice"), "-n", NS,
           "--create-namespace", "--wait", "--timeout=10m", *values)


@step("pool-cpu.yaml applied and Ready")
def apply_pool(c: Cluster) -> None:
    c.kubectl("apply", "-n", NS, "-f", str(ROOT / "charts/sluice/examples/pool-cpu.yaml"))
    c.kubectl("wait", "-n", NS, "--for=condition=Ready", f"inferencepools.sluice.dev/{POOL}",
              "--timeout=15m")


def api_key(c: Cluster) -> str:
    secret = c.json("secret", "-n", NS, "sluice-api-keys")
    return base64.b64decode(secret["data"]["default"]).decode()


def chat(url: str, key: str, content: str, max_tokens: int = 16) -> httpx.Response:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": content}]})
    response.raise_for_status()
    return response


@step("a chat completion through the chart's Envoy Service")
def completion(c: Cluster, url: str, key: str) -> None:
    # A Ready pool is the operator's view; the picker learns the pod from its own watch
    # a moment later, and until then Envoy has no engine to send to (503).
    body = eventually(lambda: chat(url, key, "What is the capital of France?").json(), 60,
                      "the gateway's first answer")
    print(f"    {body['choices'][0]['message']['content']!r}", flush=True)
    assert "Paris" in body["choices"][0]["message"]["content"], body


def _settled(c: Cluster) -> bool:
    pool = c.json("inferencepools.sluice.dev", "-n", NS, POOL)
    return pool["status"].get("observedGeneration") == pool["metadata"]["generation"]


def _engines(c: Cluster) -> dict[str, bool]:
    """The pool's engine pods by name: ready or not."""
    return {p["metadata"]["name"]: any(
        cond["type"] == "Ready" and cond["status"] == "True"
        for cond in p["status"].get("conditions", ()))
        for p in c.json("pods", "-n", NS, "-l", f"sluice.dev/pool={POOL}")["items"]}


@step("two engines, and a repeated prefix stays on one pod")
def sticky_prefix(c: Cluster, url: str, key: str) -> None:
    # Requests sized so that two engines fit the node beside the chart's pods; rolled out
    # before the second engine: the old engine's 1 CPU would leave it unschedulable, and
    # the rollout (maxUnavailable 0) would wait for it forever.
    for spec in ({"resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
                 {"replicas": 2}):
        c.kubectl("patch", "-n", NS, f"inferencepools.sluice.dev/{POOL}", "--type=merge",
                  "-p", json.dumps({"spec": spec}))
        eventually(lambda: _settled(c), 60, "the operator applied the change")
        c.kubectl("rollout", "status", "-n", NS, f"deployment/{POOL}-serve", "--timeout=15m")
    eventually(lambda: list(_engines(c).values()) == [True, True], 300,
               "exactly two ready engines")
    prefix = "You are a careful assistant. " * 40

    def ask(i: int) -> httpx.Response:
        return chat(url, key, f"{prefix} Question {i}: name a color.")
    # Once the picker's index holds the prefix (a just-started engine's first KV events
    # can reach it a request late), every request with it goes to the pod holding it.
    first = eventually(lambda: (r := ask(0)).headers["x-sluice-prefix-hit-blocks"] != "0"
                       and r, 120, "the index knows the prefix")
    after = [ask(i) for i in range(1, 6)]
    pods = {r.headers["x-sluice-pod"] for r in [first, *after]}
    assert len(pods) == 1, pods
    assert all(int(r.headers["x-sluice-prefix-hit-blocks"]) > 1 for r in after)


@step("a killed engine pod is replaced while requests keep being answered")
def kill_engine(c: Cluster, url: str, key: str) -> None:
    before = _engines(c)
    victim = min(before)
    c.kubectl("delete", "pod", "-n", NS, victim, "--wait=false")
    answered = 0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        chat(url, key, "Say hello.", max_tokens=4)  # raises on any failed request
        answered += 1
        if any(ready for name, ready in _engines(c).items() if name not in before):
            print(f"    {answered} requests answered until the new engine was ready",
                  flush=True)
            assert answered >= 2, "the replacement was ready before any request was tried"
            return
    raise AssertionError("the killed engine was not replaced")


def _replicas(c: Cluster) -> int:
    return int(c.json("inferencepools.sluice.dev", "-n", NS, POOL)["spec"]["replicas"])


@step("the autoscaler follows KV-cache usage: down idle, up under load, down again")
def autoscale(c: Cluster, url: str, key: str) -> None:
    # a target low enough for a few long requests to pass it on a 512 MiB cache
    c.kubectl("patch", "-n", NS, f"inferencepools.sluice.dev/{POOL}", "--type=merge", "-p",
              json.dumps({"spec": {"autoscaling": {
                  "enabled": True, "minReplicas": 1, "maxReplicas": 2,
                  "targetKVCacheUsage": 0.02, "scaleUpStabilizationSeconds": 0,
                  "scaleDownStabilizationSeconds": 0}}}))
    eventually(lambda: _replicas(c) == 1, 300, "scaled down to 1 while idle")
    stop = threading.Event()

    def load() -> None:
        prompt = "Tell me a long story about a lighthouse keeper. " * 30
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/completions", timeout=300,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 256,
                                 "ignore_eos": True, "temperature": 0})
    workers = [threading.Thread(target=load, daemon=True) for _ in range(8)]
    for w in workers:
        w.start()
    try:
        eventually(lambda: _replicas(c) == 2, 300, "scaled up to 2 under load")
    finally:
        stop.set()
        for w in workers:
            w.join(330)
    eventually(lambda: _replicas(c) == 1, 300, "scaled down to 1 once idle")


@step("deleting the pool removes its children")
def delete_pool(c: Cluster) -> None:
    def children() -> list[dict]:
        return c.json("deployments,services,poddisruptionbudgets", "-n", NS,
                      "-l", f"sluice.dev/pool={POOL}")["items"]
    assert children(), "the pool has children to remove"
    c.kubectl("delete", "-n", NS, f"inferencepools.sluice.dev/{POOL}", "--timeout=5m")
    eventually(lambda: not children(), 300, "children garbage-collected")


@step("helm uninstall leaves nothing behind")
def uninstall(c: Cluster) -> None:
    c.helm("uninstall", "sluice", "-n", NS, "--wait", "--timeout=5m")
    eventually(lambda: not c.json("all", "-n", NS)["items"], 300, "the namespace emptied")
    assert not c.json("inferencepools.sluice.dev", "-A")["items"]  # no finalizer left
    left = c.kubectl("get", "clusterroles,clusterrolebindings", "-o", "name",
                     "-l", "app.kubernetes.io/instance=sluice")
    assert not left.strip(), left


@step("GIE mode: GIE's CRD, the chart with gie.enabled, the GIE InferencePool accepted and "
      "its own picker serving")
def gie_mode(c: Cluster) -> None:
    c.kubectl("apply", "--server-side", "-f",
              str(ROOT / "tests/crds/gie/inference.networking.k8s.io_inferencepools.yaml"))
    # the Gateway's data plane here is the chart's own Envoy, in the release namespace
    install(c, {"gie.enabled": "true", "networkPolicy.gatewayFrom[0].namespaceSelector."
                "matchLabels.kubernetes\\.io/metadata\\.name": NS})
    apply_pool(c)
    gie = c.json("inferencepools.inference.networking.k8s.io", "-n", NS, POOL)
    picker = gie["spec"]["endpointPickerRef"]
    assert (picker["name"], picker["port"]["number"]) == (f"{POOL}-epp", 9002), picker
    # the pool's own picker (the chart's, scoped by --pool-name) runs and is Ready
    c.kubectl("wait", "-n", NS, "--for=condition=Available", f"deployment/{POOL}-epp",
              "--timeout=5m")
    with c.port_forward("svc/sluice-gateway", 80) as url:
        completion(c, url, api_key(c))
    delete_pool(c)
    eventually(lambda: not c.json("inferencepools.inference.networking.k8s.io", "-n",
                                  NS)["items"], 120, "the GIE pool removed with ours")
    uninstall(c)


def run(kubeconfig: pathlib.Path) -> None:
    c = Cluster(kubeconfig)
    install(c)
    apply_pool(c)
    key = api_key(c)
    with c.port_forward("svc/sluice-gateway", 80) as url:
        completion(c, url, key)
        sticky_prefix(c, url, key)
        kill_engine(c, url, key)
        autoscale(c, url, key)
    delete_pool(c)
    uninstall(c)
    gie_mode(c)
