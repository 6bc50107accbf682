"""The other tensor-parallel ranks (1 .. N-1) as worker processes, driven by rank 0: the
engine, in the engine core process. This is vLLM's multiprocess executor with its driver
worker in the engine's process, so sampling never leaves it.

- Start: rank 0 spawns the workers; every rank joins the group (a file rendezvous in a
  private directory) and loads its own shard while the others load theirs.
- Each step: rank 0 publishes the step's inputs (messages.py) on a ZMQ XPUB socket over
  IPC in that directory; every worker runs the model on them, meeting rank 0 in the
  layers' all-reduces and the LM head's gather; rank 0 samples. The first publish waits
  until every worker has subscribed, so no worker misses a step.
- A worker that dies: a monitor thread sees it at once, logs its rank and exit code, and
  ends this process with exit code 1 (rank 0 may be blocked in a collective the dead rank
  never joins, which no exception would end). The API process then reports the engine
  dead and exits; the pod restarts.
- Close: an empty message; the workers leave the group with rank 0 and exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import zmq

from sluice.engine.config import EngineConfig
from sluice.engine.distributed.messages import GatherKV, ScatterKV, StepInput, encoder
from sluice.engine.distributed.parallel_state import TPGroup
from sluice.engine.distributed.shm_all_reduce import create_segment
from sluice.engine.distributed.worker import WorkerSpec

log = logging.getLogger("sluice.engine.tp")

SUBSCRIBE_TIMEOUT_S = 60.0


def _exit_engine(rank: int, pid: int, code: int | None) -> None:
    log.error("tensor-parallel worker rank %d (pid %d) exited with code %s: the engine stops",
              rank, pid, code)
    logging.shutdown()
    os._exit(1)


class TPWorkers:
    def __init__(self, config: EngineConfig, num_threads: int,
                 on_death: Callable[[int, int, int | None], None] = _exit_engine):
        """Spawn ranks 1 .. N-1; `on_death(rank, pid, exit code)` runs on the monitor
        thread when one ends before `close` (default: log it and exit 1)."""
        n = config.parallel.tensor_parallel_size
        assert n > 1, "a group of one has no workers"
        # (mode 0700: private sockets and memory; in memory where /dev/shm is)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.dir = tempfile.mkdtemp(prefix="sluice-tp-", dir=shm)
        self.init_method = f"file://{self.dir}/rendezvous"
        self.shm_path = os.path.join(self.dir, "all_reduce")
        create_segment(self.shm_path, n)
        address = f"ipc://{self.dir}/steps"
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step (workers keep up by design)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every worker's subscription, not the first
        self.pub.bind(address)
        self.num_workers, self._subscribed, self._closing = n - 1, False, False
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.procs = []
        for rank in range(1, n):
            spec_path = os.path.join(self.dir, f"rank{rank}.spec")
            with open(spec_path, "wb") as f:
                pickle.dump(WorkerSpec(config, rank, n, self.init_method, self.shm_path,
                                       address, num_threads, level), f)
            # (a process of its own, not a multiprocessing child: the engine core may be a
            # daemonic process, which multiprocessing forbids children)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "sluice.engine.distributed.worker", spec_path]))
        self._on_death = on_death
        for rank, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, p), name=f"tp-monitor-{rank}",
                             daemon=True).start()

    def broadcast(self, msg: StepInput | GatherKV | ScatterKV) -> None:
        if not self._subscribed:
            self._wait_subscribed()
        self.pub.send(encoder.encode(msg))

    def close(self, tp: TPGroup) -> None:
        """Stop the workers: they leave the group `tp` together with rank 0, and exit."""
        self._closing = True
        if all(p.poll() is None for p in self.procs):
            # (after the engine started, every worker has subscribed: it does so first)
            if not self._subscribed:
                self._wait_subscribed()
            self.pub.send(b"")
            tp.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.pub.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait_subscribed(self) -> None:
        """XPUB hands rank 0 one message per subscription: wait for every worker's."""
        deadline, seen = time.monotonic() + SUBSCRIBE_TIMEOUT_S, 0
        while seen < self.num_workers:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pub.poll(int(left * 1000)):
                raise RuntimeError(f"{self.num_workers - seen} tensor-parallel workers did not "
                                   f"subscribe within {SUBSCRIBE_TIMEOUT_S:.0f} s")
            if self.pub.recv()[:1] == b"\x01":
                seen += 1
        self._subscribed = True

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            self._on_death(rank, proc.pid, code)
