"""What a user does with the one-node cluster, checked step by step: the chart installed
from the local images, `pool-cpu.yaml` applied and Ready, chat completions through the
chart's Envoy Service, a repeated prefix kept on one pod, a killed engine replaced while
requests keep being answered, the pool deleted with its children, and `helm uninstall`
leaving nothing behind."""

from __future__ import annotations

import base64
import contextlib
import json
import pathlib
import socket
import subprocess
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
def install(c: Cluster) -> None:
    values = [f"--set={k}={v}" for k, v in VALUES.items()]
    c.helm("install", "sluice", str(ROOT / "charts" / "sluice"), "-n", NS,
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
    body = chat(url, key, "What is the capital of France?").json()
    assert body["choices"][0]["message"]["content"], body


@step("two engines, and a repeated prefix stays on one pod")
def sticky_prefix(c: Cluster, url: str, key: str) -> None:
    # requests sized so that two engines fit the node beside the chart's pods
    c.kubectl("patch", "-n", NS, f"inferencepools.sluice.dev/{POOL}", "--type=merge", "-p",
              json.dumps({"spec": {"replicas": 2, "resources": {
                  "requests": {"cpu": "250m", "memory": "1Gi"}}}}))
    eventually(lambda: c.json("inferencepools.sluice.dev", "-n", NS, POOL)["status"].get(
        "readyReplicas") == 2, 900, "two ready engines")
    prefix = "You are a careful assistant. " * 40
    pods = {chat(url, key, f"{prefix} Question {i}: name a color.").headers["x-sluice-pod"]
            for i in range(6)}
    assert len(pods) == 1, pods


@step("a killed engine pod is replaced while requests keep being answered")
def kill_engine(c: Cluster, url: str, key: str) -> None:
    pods = c.json("pods", "-n", NS, "-l", f"sluice.dev/pool={POOL}")["items"]
    victim = pods[0]["metadata"]["name"]
    c.kubectl("delete", "pod", "-n", NS, victim, "--wait=false")
    answered = 0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        chat(url, key, "Say hello.", max_tokens=4)  # raises on any failed request
        answered += 1
        names = {p["metadata"]["name"]: p for p in
                 c.json("pods", "-n", NS, "-l", f"sluice.dev/pool={POOL}")["items"]}
        ready = [n for n, p in names.items() if n != victim and any(
            cond["type"] == "Ready" and cond["status"] == "True"
            for cond in p["status"].get("conditions", ()))]
        if len(ready) == 2:
            print(f"    {answered} requests answered meanwhile", flush=True)
            return
    raise AssertionError("the killed engine was not replaced")


@step("deleting the pool removes its children")
def delete_pool(c: Cluster) -> None:
    c.kubectl("delete", "-n", NS, f"inferencepools.sluice.dev/{POOL}", "--timeout=5m")
    eventually(lambda: not c.json("deployments,services,poddisruptionbudgets", "-n", NS,
                                  "-l", f"sluice.dev/pool={POOL}")["items"], 300,
               "children garbage-collected")


@step("helm uninstall leaves nothing behind")
def uninstall(c: Cluster) -> None:
    c.helm("uninstall", "sluice", "-n", NS, "--wait", "--timeout=5m")
    eventually(lambda: not c.json("all", "-n", NS)["items"], 300, "the namespace emptied")
    left = c.kubectl("get", "clusterroles,clusterrolebindings", "-o", "name",
                     "-l", "app.kubernetes.io/instance=sluice")
    assert not left.strip(), left


def run(kubeconfig: pathlib.Path) -> None:
    c = Cluster(kubeconfig)
    install(c)
    apply_pool(c)
    key = api_key(c)
    with c.port_forward("svc/sluice-gateway", 80) as url:
        completion(c, url, key)
        sticky_prefix(c, url, key)
        kill_engine(c, url, key)
    delete_pool(c)
    uninstall(c)
