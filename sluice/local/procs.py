"""Child processes whose output lines are prefixed with the process name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

_COLORS = ("36", "33", "35", "32", "34", "31", "96", "93")


class Child:
    """A subprocess; a daemon thread copies its stdout+stderr line by line to `out`
    as `name | line` (coloured when `out` is a terminal). `restart()` runs the same
    command again once it has exited."""

    def __init__(self, name: str, argv: list[str], out: TextIO = sys.stdout,
                 color_index: int = 0, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        tty = hasattr(out, "isatty") and out.isatty()
        color = _COLORS[color_index % len(_COLORS)]
        self.prefix = f"\x1b[{color}m{name:<10}|\x1b[0m " if tty else f"{name:<10}| "
        self._out = out
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env,
                                     start_new_session=True,  # Ctrl-C reaches us only
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 -- prctl only
        self._pump = threading.Thread(target=self._copy, daemon=True, name=f"log-{self.name}")
        self._pump.start()

    def restart(self) -> None:
        assert not self.alive(), "restart() is for a child that exited"
        self._pump.join(2)
        self._spawn()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._out.write(self.prefix + line + "\n")
            self._out.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(2)
        return self.proc.returncode


def wait_until(check, timeout: float, what: str, children: list[Child] = ()) -> None:
    """Poll `check()` every 0.1 s; fail early if a child died, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if not c.alive():
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode} while waiting "
                                   f"for {what}")
        if check():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# Resolved here, in the parent: the child between fork and exec must not import or
# load anything (another thread of the parent may have held the lock it would need).
_PR_SET_PDEATHSIG = 1
_prctl = None
if sys.platform.startswith("linux"):
    import ctypes

    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when `sluice up` dies, even by
    SIGKILL, so no engine outlives the stack."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
