"""The cores each engine gets in `sluice bench engine --compare vllm --mode serving`.

Setups (`--thread-setups`, each one run of both engines):
- `defaults`: each engine as it starts by default. Sluice: `--num-threads` as given,
  else one CPU fewer than it may use (sluice/cpus.py). vLLM: its automatic OpenMP
  binding, which on a small machine keeps a CPU for its API process (`--vllm-env` may
  set its variables).
- `equal`: both engines compute on the same T CPUs, the first T of this process's
  affinity mask. T is `--num-threads`, else every CPU this process may use. vLLM gets
  `VLLM_CPU_OMP_THREADS_BIND` naming those CPUs and `VLLM_CPU_NUM_OF_RESERVED_CPU=0`,
  since Sluice reserves none then. Sluice gets `--num-threads T`, and is pinned to those
  CPUs with `taskset` when they are fewer than the usable ones.
Every report prints each engine's binding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SETUPS = ("defaults", "equal")


@dataclass(frozen=True)
class ThreadSetup:
    name: str
    sluice_threads: int
    sluice_cpus: tuple[int, ...] | None  # pinned to these; None: free on the usable CPUs
    vllm_env: dict[str, str] = field(default_factory=dict)

    def describe(self, usable: tuple[int, ...]) -> dict[str, str]:
        where = cpu_list(self.sluice_cpus) if self.sluice_cpus else (
            f"unpinned on CPUs {cpu_list(usable)}")
        bind = self.vllm_env.get("VLLM_CPU_OMP_THREADS_BIND", "auto (vLLM's default)")
        reserved = self.vllm_env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "vLLM's default")
        return {"sluice": f"--num-threads {self.sluice_threads}, {where}",
                "vllm": f"VLLM_CPU_OMP_THREADS_BIND={bind}, "
                        f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}"}

    def sluice_prefix(self) -> list[str]:
        """What to run `sluice engine` under (taskset when pinned)."""
        return ["taskset", "-c", cpu_list(self.sluice_cpus)] if self.sluice_cpus else []


def usable_cpu_ids() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return tuple(range(os.cpu_count() or 1))


def default_sluice_threads(num_threads: int | None, usable: int) -> int:
    from sluice.cpus import engine_threads

    return num_threads or engine_threads(usable)


def setup(name: str, num_threads: int | None, vllm_env: dict[str, str],
          usable: tuple[int, ...]) -> ThreadSetup:
    """`name`'s threads for both engines (see the module docstring); `vllm_env`: the
    user's `--vllm-env`, kept in `defaults` and overridden in `equal`."""
    if name == "defaults":
        return ThreadSetup(name, default_sluice_threads(num_threads, len(usable)), None,
                           dict(vllm_env))
    assert name == "equal", name
    threads = num_threads or len(usable)
    if threads > len(usable):
        raise SystemExit(f"--num-threads {threads}: only {len(usable)} CPUs are usable")
    cpus = usable[:threads]
    env = {**vllm_env, "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return ThreadSetup(name, threads, cpus if len(cpus) < len(usable) else None, env)


def cpu_list(cpus: tuple[int, ...]) -> str:
    """`0-3,6` for (0, 1, 2, 3, 6): the form taskset and VLLM_CPU_OMP_THREADS_BIND take."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def parse_setups(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(SETUPS):
        raise SystemExit(f"--thread-setups: {text!r}: a list of {', '.join(SETUPS)}")
    return names
