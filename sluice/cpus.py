"""How many CPUs this process may really use: its affinity mask, bounded by a cgroup
CPU quota (Kubernetes `resources.limits.cpu` becomes one). A leaf module: no torch.

torch's default thread count is the machine's cores, whatever the quota: a pod
limited to 2 CPUs on a 64-core node would run 64 OpenMP threads, throttled, and
engines sharing a machine oversubscribe it (a SmolLM2 decode step went from 65 ms
to 2.5 s: docs/engine.md).
"""

from __future__ import annotations

import math
import os

_CGROUP_V2 = "/sys/fs/cgroup/cpu.max"  # "max 100000" or "<quota> <period>"
_CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def quota_cpus(cpu_max: str | None = None, cfs: tuple[str, str] | None = None) -> int | None:
    """CPUs a cgroup quota allows (rounded up), None when there is none. The texts
    of cgroup v2's cpu.max or v1's (quota, period) files; read from /sys when None."""
    if cpu_max is None and cfs is None:
        cpu_max, cfs = _read(_CGROUP_V2), None
        if cpu_max is None:
            quota, period = _read(_CGROUP_V1[0]), _read(_CGROUP_V1[1])
            cfs = (quota, period) if quota is not None and period is not None else None
    if cpu_max is not None:
        quota, _, period = cpu_max.strip().partition(" ")
    elif cfs is not None:
        quota, period = cfs[0].strip(), cfs[1].strip()
    else:
        return None
    if quota in ("max", "-1") or not period or int(period) <= 0 or int(quota) <= 0:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def usable_cpus() -> int:
    """The affinity mask's size, bounded by the cgroup quota; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = quota_cpus()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def engine_threads(cpus: int, engines: int = 1) -> int:
    """Torch threads for each of `engines` engine cores sharing `cpus`: one CPU is left to
    the API processes (and the gateway beside them), as vLLM reserves one for its front
    end. An OpenMP thread that loses its core stalls its peers at every parallel region: a
    batch-32 decode step went from 95 ms to 640-960 ms on two threads while another
    process took one of the two cores (docs/benchmarks.md)."""
    return max(1, (cpus - 1) // engines)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
