"""`sluice up` keeps its children running: the restart policy, and a stack that loses an
engine and Redis and keeps serving."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_local_up import start_up, wait_healthy

from sluice.local.procs import Child
from sluice.local.supervisor import Supervisor


def test_restarts_back_off_double_and_reset_after_a_stable_run():
    out = io.StringIO()
    child = Child("flaky", [sys.executable, "-c", "raise SystemExit(3)"], out=io.StringIO())
    child.proc.wait()
    sup = Supervisor(out, base_s=1.0, max_s=4.0, stable_s=10.0)
    t = 0.0
    delays = []
    for _ in range(4):
        sup.check([child], now=t)  # exit seen: a restart is due
        due = t
        while child.proc.poll() is not None and t < due + 10:
            t += 0.5
            sup.check([child], now=t)
        delays.append(t - due)
        child.proc.wait()  # it exits again at once
    assert delays == [1.0, 2.0, 4.0, 4.0] and sup.restarts("flaky") == 4
    assert "flaky exited with 3; restarting it in 1 s (restart 1)" in out.getvalue()
    # a child that ran for stable_s starts the count again
    child.argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    sup.check([child], now=t)
    t += 4.0
    sup.check([child], now=t)  # restarted, now long-lived
    sup.check([child], now=t + 10.0)
    child.proc.kill()
    child.proc.wait()
    sup.check([child], now=t + 10.5)
    assert "restarting it in 1 s" in out.getvalue().splitlines()[-1]


def _pid_of(*words: bytes) -> int:
    """The process whose command line holds every one of `words`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if all(any(w in a for a in argv) for w in words):
            return int(pid)
    raise LookupError(words)


@pytest.mark.slow  # a `sluice up` stack
def test_a_killed_engine_is_restarted_while_the_other_keeps_streaming(tiny_chat_model):
    proc, url = start_up(tiny_chat_model, 2, "--num-kv-blocks 256 --max-model-len 1024",
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(
        line.decode(errors="replace") for line in proc.stdout), daemon=True).start()
    try:
        wait_healthy(proc, url)
        body = {"model": "tiny", "prompt": "A long story", "max_tokens": 300,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            survivor = r.headers["x-sluice-pod"]
            victim = next(p for p in httpx.get(url + "/health").json()["pods"] if p != survivor)
            lines = r.iter_lines()
            next(lines)
            port = victim.rsplit(":", 1)[1].encode()
            os.kill(_pid_of(b"engine", b"--port", port), signal.SIGKILL)
            rest = list(lines)  # the stream on the other engine goes on to its end
        assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
        for i in range(4):  # new requests keep succeeding meanwhile
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": f"next {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        deadline = time.time() + 90  # and the engine is back, on its address

        def back() -> bool:
            try:
                engine_up = httpx.get(f"http://{victim}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
            return engine_up and httpx.get(url + "/health").json()["pods"].get(victim)

        while not (any("restarted (restart 1)" in line for line in log) and back()):
            assert proc.poll() is None and time.time() < deadline, "".join(log[-40:])
            time.sleep(0.5)
        # Redis too: routing goes on from the local view, then Redis is back in use
        redis_port = next(line for line in log if "sluice up: gateway on" in line) \
            .split("redis redis://127.0.0.1:")[1].split("/")[0]
        os.kill(_pid_of(b"redis-server", redis_port.encode()), signal.SIGKILL)
        for i in range(4):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": f"no redis {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        deadline = time.time() + 60
        while not (any("redis      exited" in line or "redis exited" in line for line in log)
                   and httpx.get(url + "/health").json()["index"] == "redis"):
            assert proc.poll() is None and time.time() < deadline, "".join(log[-40:])
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0
