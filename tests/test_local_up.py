"""`sluice up` end to end: redis-server + 2 engines (tiny model) + picker + Envoy; Ctrl-C stops
all."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from engine_server import free_port

pytestmark = pytest.mark.slow  # whole `sluice up` stacks: Redis, engines, picker, Envoy


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    """Until the stack's gateway answers /health with 200 (the stack must stay alive)."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"sluice up exited: {out[-3000:]}")
        assert time.time() < deadline, "sluice up did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def start_up(model, engines: int, engine_args: str, shape: tuple[str, ...] = (),
             **popen) -> tuple[subprocess.Popen, str]:
    """`sluice up` serving `model` as "tiny" on a free port: (process, gateway URL).
    `shape`: engine flags instead of `--engines engines` (e.g. --prefill 1 --decode 1)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "up", *(shape or ("--engines", str(engines))),
         "--model", str(model), "--served-model-name", "tiny", "--port", str(port),
         "--engine-args", engine_args], **popen)
    return proc, f"http://127.0.0.1:{port}"


def test_up_serves_prefixes_logs_and_stops_everything(tiny_chat_model):
    proc, url = start_up(tiny_chat_model, 2, "--num-kv-blocks 256 --max-model-len 1024",
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_healthy(proc, url)
        pods = list(httpx.get(url + "/health").json()["pods"])
        assert len(pods) == 2
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.headers["x-sluice-index"] == "redis"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    log = out.decode()
    assert proc.returncode == 0, log[-3000:]
    for name in ("redis", "engine-0", "engine-1", "picker", "envoy"):
        assert any(line.startswith(f"{name:<10}| ") for line in log.splitlines()), name
    for pod in pods:  # every engine is gone
        try:
            httpx.get(f"http://{pod}/health", timeout=1)
            raise AssertionError(f"{pod} still serving")
        except httpx.ConnectError:
            pass


def test_killed_stack_leaves_no_engine(tiny_chat_model):
    """Even a SIGKILLed `sluice up` takes its children with it (PR_SET_PDEATHSIG)."""
    proc, url = start_up(tiny_chat_model, 1, "--num-kv-blocks 64 --max-model-len 512",
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, url)
        pods = list(httpx.get(url + "/health").json()["pods"])
    finally:
        proc.kill()
        proc.wait()
    # a probe during shutdown may be accepted then reset: only a refused connection
    # means the process is gone
    deadline = time.time() + 30
    alive = [f"http://{pod}" for pod in pods] + [url]
    while alive and time.time() < deadline:
        time.sleep(0.3)
        for base in list(alive):
            try:
                httpx.get(base + "/health", timeout=1)
            except httpx.ConnectError:
                alive.remove(base)
            except httpx.TransportError:
                pass  # shutting down
    assert not alive, f"still serving after `sluice up` was killed: {alive}"
