"""The processes `sluice bench engine --compare vllm` starts, and how they end.

Every process is started in its own session (so Ctrl-C reaches only the bench)
with a parent-death signal (`sluice.local.procs.Child`), and stopped as a whole
process group: vLLM's API server forks an engine-core process, which a SIGTERM
to the API server alone may leave behind. `stop()` sends SIGTERM to the group,
waits, then SIGKILLs what is left. `sigterm_exits()` turns a SIGTERM of the bench
into SystemExit so the callers' `finally` blocks stop their servers then too.

Output of each process goes to a log file; a failure quotes its tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx

from sluice.local.procs import Child, wait_until
from sluice.local.stack import free_port


class Process:
    """A child process (and its process group) whose output goes to `log_path`."""

    def __init__(self, name: str, argv: list[str], log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 -- closed by stop()
        self.child = Child(name, argv, out=self._log, env=env)

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait(self, timeout: float) -> int:
        """Exit code; raises TimeoutError (the process keeps running) after `timeout` s."""
        try:
            return self.child.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout:.0f}s") from None

    def stop(self, timeout: float = 20.0) -> None:
        proc = self.child.proc
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        _killpg(proc.pid, signal.SIGKILL)  # the group's other members, if any are left
        self.child.stop(timeout=5)
        self._log.close()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class Server:
    """An OpenAI-compatible server: one the bench started (`process`) or was given."""

    def __init__(self, name: str, url: str, process: Process | None = None) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.process = process

    def wait_ready(self, timeout: float) -> Server:
        """Poll /health until 200 (vLLM answers only once the model is loaded and compiled)."""
        children = [self.process.child] if self.process else []
        try:
            wait_until(lambda: _ok(self.url + "/health"), timeout, f"{self.name} at {self.url}",
                       children)
        except (RuntimeError, TimeoutError) as err:
            tail = f"\n--- {self.process.log_path} ---\n{self.process.log_tail()}" \
                if self.process else ""
            raise RuntimeError(f"{err}{tail}") from None
        return self

    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_vllm(python: str, model_dir: str, log_dir: Path, *, dtype: str, max_model_len: int,
               seed: int, served_name: str, kv_space_gib: int, extra_args: list[str],
               extra_env: dict[str, str]) -> Server:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port.

    VLLM_CPU_KVCACHE_SPACE (whole GiB) is vLLM's KV budget on CPU, as
    --kv-cache-memory is Sluice's; vLLM picks its own block size (128 on CPU)."""
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", served_name, "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--seed", str(seed),
            "--host", "127.0.0.1", "--port", str(port), *extra_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), **extra_env}
    process = Process("vllm", argv, log_dir / "vllm.log", env=env)
    return Server("vllm", f"http://127.0.0.1:{port}", process)


def start_sluice(engine_args: list[str], log_dir: Path) -> Server:
    """`sluice engine` with the bench's engine flags, on a free loopback port."""
    port = free_port()
    argv = [sys.executable, "-m", "sluice.cli", "engine", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *engine_args]
    process = Process("sluice", argv, log_dir / "sluice.log")
    return Server("sluice", f"http://127.0.0.1:{port}", process)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside: SIGTERM raises SystemExit(143) in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so `finally` blocks stop the servers either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
