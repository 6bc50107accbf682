"""Build C sources with the machine's compiler and load them (ctypes): the engine's CPU
kernels (attention/cpu_attention.c, model/cpu_ops.c).

Each source is compiled once per source text, compiler, flags and CPU (the flags include
`-march=native`: the cache key includes the CPU's model and flags, so an image moved to
another machine recompiles instead of faulting) into `$XDG_CACHE_HOME/sluice/kernels`, else
a per-user temporary folder; either is used only when no other user can write to it.
Engines starting together race safely: each compiles to a private name and renames it
into place. With no compiler, or a failed build, `build()` returns None (logged) and the
caller keeps its PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def arch_flag() -> str:
    return "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(source: Path, flags: list[str]) -> Path | None:
    """The shared library of `source` built with `flags`, or None (logged once per call)."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (gcc or $CC) for %s; using the PyTorch path", source.name)
        return None
    return _build(cc, source, flags)


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in keep}))


def _cache_dirs() -> list[Path]:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "sluice" / "kernels",
            Path(tempfile.gettempdir()) / f"sluice-kernels-{os.getuid()}"]


def _texts(source: Path) -> list[str]:
    """The source and the local headers it includes (`#include "name"`, next to it): an
    edited header must not load a library built from the old one."""
    text = source.read_text()
    names = re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, flags=re.MULTILINE)
    return [text, *((source.parent / name).read_text() for name in names)]


def _private(folder: Path) -> bool:
    """True when only this user can write to `folder` (created 0700 if missing): a shared
    temporary folder must not let another user plant the library this process loads."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(compiler: str, source: Path, flags: list[str]) -> Path | None:
    try:
        version = subprocess.run([compiler, "--version"], check=False, capture_output=True,
                                 text=True).stdout
    except OSError as exc:
        log.warning("C compiler %s unusable (%s); using the PyTorch path for %s",
                    compiler, exc, source.name)
        return None
    key = hashlib.sha256("\0".join([*_texts(source), compiler, version, " ".join(flags),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    for folder in _cache_dirs():
        if not _private(folder):
            continue
        target = folder / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        try:
            fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
            os.close(fd)
        except OSError:
            continue
        result = subprocess.run([compiler, *flags, str(source), "-o", partial],
                                check=False, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(partial)
            log.warning("%s failed to compile (%s); using the PyTorch path:\n%s",
                        source.name, compiler, result.stderr[-2000:])
            return None
        os.replace(partial, target)
        return target
    log.warning("no private, writable cache folder for %s (%s); using the PyTorch path",
                source.name, ", ".join(str(f) for f in _cache_dirs()))
    return None
