"""The cores each engine gets in `sluice bench engine --compare vllm --mode serving`.

Setups (`--thread-setups`, each one run of both engines):
- `defaults`: each engine as it starts by default. Sluice runs `--num-threads` as given,
  else one CPU fewer than it may use (sluice/cpus.py). vLLM runs its automatic OpenMP
  binding, which on a small machine keeps a CPU for its API process.
- `equal` (or `equal:T`): both engines compute on T threads. T is `:T`, else
  `--num-threads`, else every CPU this process may use.
  - vLLM's OpenMP threads are bound to the first T CPUs of the affinity mask
    (`VLLM_CPU_OMP_THREADS_BIND`), with `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: Sluice keeps
    no CPU aside either.
  - Sluice gets `--num-threads T`.
  - Neither engine's API process is pinned.
In every setup vLLM runs with the allocator and OpenMP runtime its CPU guide preloads
(tcmalloc, and the libiomp5 of its own environment), where they are installed. A
`--vllm-env` the user gives wins. Every report prints each engine's setup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SETUPS = ("defaults", "equal")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")


@dataclass(frozen=True)
class ThreadSetup:
    name: str
    sluice_threads: int
    vllm_env: dict[str, str] = field(default_factory=dict)

    def describe(self, usable: tuple[int, ...]) -> dict[str, str]:
        env = self.vllm_env
        return {"sluice": f"--num-threads {self.sluice_threads}, unpinned on CPUs "
                          f"{cpu_list(usable)}",
                "vllm": ", ".join(f"{k}={env.get(k, 'its default')}" for k in (
                    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD"))}


def usable_cpu_ids() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def vllm_preload(python: str | None) -> str | None:
    """vLLM's recommended LD_PRELOAD on CPU: tcmalloc and its environment's libiomp5, those
    of them that exist; None when neither does."""
    found = [p for p in TCMALLOC if os.path.exists(p)][:1]
    if python:
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # (the venv's, unresolved)
        if iomp.exists():
            found.append(str(iomp))
    return ":".join(found) or None


def setup(name: str, num_threads: int | None, vllm_env: dict[str, str],
          usable: tuple[int, ...], preload: str | None = None) -> ThreadSetup:
    """`name`'s threads for both engines (see the module docstring); `vllm_env`: the
    user's `--vllm-env`, which wins over what a setup sets."""
    base = {"LD_PRELOAD": preload} if preload else {}
    if name == "defaults":
        from sluice.cpus import engine_threads

        return ThreadSetup(name, num_threads or engine_threads(len(usable)),
                           {**base, **vllm_env})
    kind, _, count = name.partition(":")
    assert kind == "equal", name
    threads = int(count) if count else num_threads or len(usable)
    if not 1 <= threads <= len(usable):
        raise SystemExit(f"{name}: {threads} threads, but {len(usable)} CPUs are usable")
    env = {**base, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(usable[:threads]),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **vllm_env}
    return ThreadSetup(f"equal:{threads}", threads, env)


def cpu_list(cpus: tuple[int, ...]) -> str:
    """`0-3,6` for (0, 1, 2, 3, 6): the form VLLM_CPU_OMP_THREADS_BIND takes."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def parse_setups(text: str) -> list[str]:
    """`defaults,equal,equal:1`: the setup names, checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        kind, sep, count = n.partition(":")
        if kind not in SETUPS or (sep and (kind != "equal" or not count.isdigit())):
            raise SystemExit(f"--thread-setups: {n!r}: defaults, equal or equal:THREADS")
    if not names:
        raise SystemExit("--thread-setups: name at least one setup")
    return names
