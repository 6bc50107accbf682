"""The cluster's processes: started in their own sessions, logged to `<dir>/logs`, recorded
in `<dir>/pids` so that a later `down` (another process, after a crash) stops them too."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time


def start(base: pathlib.Path, name: str, argv: list[str],
          env: dict[str, str] | None = None) -> subprocess.Popen:
    (base / "logs").mkdir(parents=True, exist_ok=True)
    (base / "pids").mkdir(parents=True, exist_ok=True)
    log = open(base / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (the process owns it)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    (base / "pids" / name).write_text(str(proc.pid))
    return proc


def stop_all(base: pathlib.Path, order: list[str], grace_s: float = 10.0) -> None:
    """Stop every recorded process, those named in `order` first and in that order."""
    folder = base / "pids"
    if folder.exists():
        rest = sorted(p.name for p in folder.iterdir() if p.name not in order)
        stop(base, [*order, *rest], grace_s)


def stop(base: pathlib.Path, names: list[str], grace_s: float = 10.0) -> None:
    """Stop the named processes that were recorded, in order, each with its process
    group: SIGTERM, then SIGKILL after `grace_s`."""
    folder = base / "pids"
    for name in names:
        if not (folder / name).exists():
            continue
        pid = int((folder / name).read_text())
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _exists(pid):
            time.sleep(0.1)
        _signal_group(pid, signal.SIGKILL)
        (folder / name).unlink()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(base: pathlib.Path, name: str, lines: int = 40) -> str:
    path = base / "logs" / f"{name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])
