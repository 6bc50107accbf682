"""`sluice bench step`: where one engine step's time goes, phase by phase and op by op.

Fills a batch of `--batch-size` requests (prompts of random token ids, lengths uniform in
[--min-len, --max-len], seed-fixed, sampled at temperature 1 with ignore_eos), steps until
every request has finished its prefill, then times `--steps` decode steps. Each phase is
timed by wrapping the engine's own methods (no engine code is instrumented):

  schedule   Scheduler.schedule
  forward    ModelRunner._forward / the decode-graph runner (inputs prepared + model run)
  logits     CausalLM.compute_logits
  sample     the sampler
  rest       step time minus the above (block tables, inputs built, outputs, metrics)

`--profile-ops N` then runs `torch.profiler` over N more steps and prints the top ops by
self CPU time per step, and, with `--tensor-parallel-size` > 1, rank 0's time in the
collectives per step (the wait for the other ranks included).

`--prefill-tokens N` also times prefill: a step that prefills one N-token prompt alone
(before the batch is filled; three prompts, mean), and a mixed step where such a prompt
joins the running decode batch (after the decode timing; three, mean).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

from sluice.engine.cli import add_arguments as add_engine_arguments
from sluice.engine.cli import engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed")
    p.add_argument("--profile-ops", type=int, default=5,
                   help="decode steps run under torch.profiler afterwards (0: none)")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time prefill steps of prompts this long, alone and beside "
                        "the decode batch (0: none)")
    p.add_argument("--output-json", default=None)


class PhaseTimer:
    """Wraps callables so each call adds its wall time to a named phase."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def fill_batch(llm, args) -> None:
    from sluice.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    vocab = llm.model.config.vocab_size
    budget = args.steps * 2 + args.profile_ops + 8
    for i in range(args.batch_size):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        llm.add_request(f"step-{i}", prompt, SamplingParams(
            max_tokens=budget, temperature=1.0, ignore_eos=True, seed=i))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.scheduler.running) or (
            llm.scheduler.waiting):
        llm.step()
    assert len(llm.scheduler.running) == args.batch_size, "the batch did not fit; raise the KV pool"


def time_phases(llm, steps: int) -> dict[str, float]:
    """Mean milliseconds per decode step, by phase."""
    from sluice.engine import model_runner

    timer = PhaseTimer()
    timer.wrap(llm.scheduler, "schedule", "schedule")
    timer.wrap(llm.runner, "_forward", "forward")
    timer.wrap(llm.model, "compute_logits", "logits")
    timer.wrap(model_runner, "sample", "sample")
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        total = time.perf_counter() - t0
    finally:
        timer.restore()
    phases = {k: v * 1e3 / steps for k, v in timer.totals.items()}
    phases["step"] = total * 1e3 / steps
    phases["rest"] = phases["step"] - sum(v for k, v in phases.items() if k != "step")
    return phases


def time_prefills(llm, num_tokens: int, seed: int, count: int = 3) -> float:
    """Mean milliseconds of a step that schedules one new `num_tokens` prompt (whole: the
    prompt must fit the step's token budget), beside whatever is running."""
    from sluice.engine.sampling_params import SamplingParams

    budget = llm.scheduler.config.max_num_batched_tokens - len(llm.scheduler.running)
    assert num_tokens <= budget, f"--prefill-tokens above the step's budget ({budget})"
    rng, vocab = random.Random(seed), llm.model.config.vocab_size
    total = 0.0
    for i in range(count):
        rid = f"prefill-{seed}-{i}"
        llm.add_request(rid, [rng.randrange(vocab) for _ in range(num_tokens)],
                        SamplingParams(max_tokens=1, temperature=0))
        t0 = time.perf_counter()
        llm.step()
        total += time.perf_counter() - t0
        while any(r.request_id == rid for r in llm.scheduler.running):
            llm.step()  # its last token, sampled with the decodes' next step
    return total * 1e3 / count


COLLECTIVES = ("c10d::", "sluice::shm_all_reduce")  # the tensor-parallel ranks' ops


def profile_ops(llm, steps: int, top: int = 12) -> tuple[list[tuple[str, float]], float]:
    """(op, self CPU ms per step) for the `top` most expensive ops, and the ms per step
    spent in collectives (with their children: a rank's wait for the others included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    collectives = sum(e.cpu_time_total for e in events if e.key.startswith(COLLECTIVES))
    return ([(e.key, e.self_cpu_time_total / 1e3 / steps) for e in rows[:top]],
            collectives / 1e3 / steps)


def main(args: argparse.Namespace) -> int:
    import torch

    from sluice.engine.llm_engine import LLMEngine

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    llm = LLMEngine(engine_config(args))
    try:
        return _measure(llm, args)
    finally:
        llm.close()


def _measure(llm, args: argparse.Namespace) -> int:
    import torch

    if args.prefill_tokens:
        time_prefills(llm, args.prefill_tokens, seed=-1, count=1)  # first-call allocations
        prefill_alone = time_prefills(llm, args.prefill_tokens, seed=-2)
    fill_batch(llm, args)
    llm.step()  # one untimed decode step: first-call allocations
    context = sum(r.num_tokens for r in llm.scheduler.running) / args.batch_size
    phases = time_phases(llm, args.steps)
    backend = type(llm.model.attn_backend).__name__
    result = {"batch_size": args.batch_size, "mean_context": context, "dtype": str(llm.dtype),
              "attention_backend": backend,
              "threads": torch.get_num_threads(), "tensor_parallel_size": llm.tp.world_size,
              "date": time.strftime("%Y-%m-%d"),
              **{f"{k}_ms": v for k, v in phases.items()}}
    order = ["step", "schedule", "forward", "logits", "sample", "rest"]
    ranks = llm.tp.world_size
    print(f"decode step, batch {args.batch_size}, mean context {context:.0f} tokens, "
          f"{llm.dtype}, {ranks} rank{'s' * (ranks > 1)} x {torch.get_num_threads()} "
          f"threads, {backend}")
    for k in order:
        print(f"  {k:>9}: {phases.get(k, 0.0):8.2f} ms")
    if args.prefill_tokens:
        mixed = time_prefills(llm, args.prefill_tokens, seed=-3)
        result.update(prefill_tokens=args.prefill_tokens, prefill_alone_ms=prefill_alone,
                      prefill_with_batch_ms=mixed)
        print(f"  a {args.prefill_tokens}-token prefill: {prefill_alone:.2f} ms alone, "
              f"{mixed:.2f} ms beside the {args.batch_size} decodes")
    if args.profile_ops:
        ops, collectives = profile_ops(llm, args.profile_ops)
        result.update(ops_ms=dict(ops), collectives_ms=collectives)
        if llm.tp.world_size > 1:
            print(f"  collectives (all-reduce, gather): {collectives:.2f} ms per step")
        print("  top ops (self CPU ms per step):")
        for name, ms in ops:
            print(f"    {ms:8.2f}  {name}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
