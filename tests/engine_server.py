"""Start real `sluice engine` processes on free loopback ports for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sluice.local.stack import free_port


class EngineProcess:
    def __init__(self, *args: str, log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sluice.cli", "engine", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.log_path = log_path or Path(f"/tmp/sluice-engine-{self.port}.log")
        # One torch thread per engine: oversubscribed OpenMP threads on a shared
        # 2-core machine make each step tens of times slower.
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(self.log_path, "w") as log:  # the child holds its own copy of the file
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> EngineProcess:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()  # never leave a half-started engine loading on a shared machine
        raise TimeoutError(f"engine not ready: {self.log_path.read_text()[-3000:]}")

    def metric(self, name: str, label: str = "") -> float:
        """Sum of a metric's samples in /metrics whose labels contain `label`."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith((name + "{", name + " ")) and label in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
