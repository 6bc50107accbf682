"""The CPUs a process may use: affinity mask and cgroup quota (`sluice/cpus.py`)."""

import os
import subprocess
import sys

import pytest

from sluice.cpus import quota_cpus, usable_cpus


def test_cgroup_quotas_in_both_formats():
    assert quota_cpus(cpu_max="max 100000\n") is None
    assert quota_cpus(cpu_max="200000 100000\n") == 2
    assert quota_cpus(cpu_max="150000 100000") == 2  # 1.5 CPUs: two threads, throttled less
    assert quota_cpus(cpu_max="50000 100000") == 1
    assert quota_cpus(cfs=("-1\n", "100000\n")) is None
    assert quota_cpus(cfs=("400000\n", "100000\n")) == 4


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_an_affinity_mask_bounds_the_engines_threads():
    """An engine pinned to one CPU runs torch on one thread."""
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from sluice.cpus import usable_cpus; print(usable_cpus())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)


def test_engine_cores_leave_one_cpu_to_the_api_processes():
    from sluice.cpus import engine_threads

    assert [engine_threads(c) for c in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert [engine_threads(8, n) for n in (1, 2, 3, 8)] == [7, 3, 2, 1]
