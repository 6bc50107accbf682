"""The soak's view of the stack's processes: their memory over time, and the faults it
injects (helper of `sluice bench soak`). Linux only: it reads /proc.

A process's RSS here is that of its whole tree: an engine is its HTTP server plus the
engine-core process it starts, and both hold memory a leak could grow.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from sluice.local.procs import Child

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    """pid -> its child pids, from every /proc/<pid>/stat."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the fields after the command name, which may hold spaces and parentheses
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _rss(pid: int) -> int:
    """Resident bytes of `pid` (0 once it is gone): statm's second field, in pages."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(pid: int, tree: dict[int, list[int]]) -> int:
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _rss(p)
        todo.extend(tree.get(p, ()))
    return total


@dataclass
class RssSampler:
    """A thread sampling the RSS (MiB) of each named child every `every_s`. It owns
    `samples` until `stop()` returns; the children list is read, never changed."""

    children: list[Child]
    every_s: float
    t0: float
    samples: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            tree = _children()
            now = time.monotonic() - self.t0
            for child in self.children:
                pid = child.proc.pid  # (a restart swaps `proc`: the new process from then on)
                if child.alive():
                    mib = tree_rss(pid, tree) / 2**20
                    self.samples.setdefault(child.name, []).append((round(now, 2), pid,
                                                                    round(mib, 2)))


def kill(child: Child) -> int:
    """SIGKILL `child`'s process, as a crash would end it; returns its pid."""
    pid = child.proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(child: Child, old_pid: int, timeout_s: float) -> bool:
    """Until the supervisor has started `child` again (a new, living pid)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.pid != old_pid and child.alive():
            return True
        time.sleep(0.1)
    return False
