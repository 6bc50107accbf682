"""A tensor-parallel worker process (ranks 1 .. N-1; workers.py drives them): it joins the
group, builds its shard of the model and the KV cache for its heads as rank 0 does
(model_setup.py), then runs the model on every step rank 0 publishes until an empty
message, and leaves the group. It dies with rank 0's process (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from sluice.engine.config import EngineConfig

log = logging.getLogger("sluice.engine.tp")


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    world_size: int
    init_method: str  # the group's rendezvous
    shm_path: str  # the shared-memory all-reduce's segment (CPU)
    step_address: str  # rank 0's step publisher
    num_threads: int  # this rank's
    log_level: str = "INFO"


def pin_rank_cores(rank: int, num_threads: int) -> None:
    """CPU: rank r runs on the r-th group of num_threads usable cores, where there are
    enough for every rank's group (else the OS places the threads)."""
    usable = sorted(os.sched_getaffinity(0))
    group = usable[rank * num_threads:(rank + 1) * num_threads]
    if len(group) == num_threads:
        os.sched_setaffinity(0, group)


def run_worker(spec: WorkerSpec) -> None:
    from sluice.engine.core.process import die_with_parent, native_library_defaults

    die_with_parent()
    native_library_defaults(os.environ)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: "
                               "%(message)s")
    import torch
    import zmq

    from sluice.engine.distributed.kv_shards import gather_blocks, scatter_blocks
    from sluice.engine.distributed.messages import GatherKV, ScatterKV, StepInput, decoder
    from sluice.engine.distributed.parallel_state import init_tensor_parallel
    from sluice.engine.model_setup import build_model_runner, resolve_device, resolve_dtype

    cfg = spec.config
    ctx = zmq.Context()
    steps = ctx.socket(zmq.SUB)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.connect(spec.step_address)
    device = resolve_device(cfg.device, spec.rank)
    if device.type == "cpu":
        pin_rank_cores(spec.rank, spec.num_threads)
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(cfg.seed)
    tp = init_tensor_parallel(spec.rank, spec.world_size, spec.init_method, device,
                              spec.shm_path)
    runner = build_model_runner(cfg, device, resolve_dtype(cfg.dtype, device), tp)
    log.info("tensor-parallel rank %d of %d ready on %s", spec.rank, spec.world_size, device)
    heads = runner.model.config.num_key_value_heads
    handlers = {
        StepInput: runner.run,
        GatherKV: lambda m: gather_blocks(runner.kv_caches, m.block_ids, tp, heads),
        ScatterKV: lambda m: scatter_blocks(runner.kv_caches, m.block_ids, None, tp, heads),
    }
    with torch.inference_mode():
        while msg := steps.recv():
            m = decoder.decode(msg)
            handlers[type(m)](m)
    tp.close()
    steps.close(linger=0)
    ctx.term()


if __name__ == "__main__":  # python -m sluice.engine.distributed.worker SPEC (workers.py)
    import pickle
    import sys

    with open(sys.argv[1], "rb") as f:
        run_worker(pickle.load(f))
