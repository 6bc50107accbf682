"""`sluice bench engine`: offline throughput (nano-vllm workload) and latency (TTFT / TPOT).

Throughput: N sequences with random prompt and output lengths uniform in
[min-len, max-len] (seed-fixed, ignore_eos), all submitted at once; prints
output and total tokens/s. Latency: one batch of fixed prompt/output lengths;
TTFT is the prefill step, TPOT the mean decode step after it. `--compare vllm`
runs the throughput workload, or a serving workload (`--mode serving`), on vLLM
first (engine_compare.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from sluice.bench.engine_compare import add_arguments as add_compare_arguments
from sluice.engine.cli import add_arguments as add_engine_arguments
from sluice.engine.cli import engine_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--mode", choices=["throughput", "latency", "serving", "spec"],
                   default="throughput",
                   help="serving: with --compare vllm, streaming requests to both servers; "
                        "spec: --speculative-config against none (bench/spec_decode.py)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=512, help="latency mode")
    p.add_argument("--output-len", type=int, default=128, help="latency mode")
    p.add_argument("--batch-size", type=int, default=1,
                   help="latency mode; spec mode: the large batch (1 is always run)")
    p.add_argument("--spec-reps", type=int, default=2,
                   help="spec mode: runs of each engine per cell, alternating (best counts)")
    p.add_argument("--peak-bandwidth", type=float, default=2.94e12,
                   help="bytes/s the bandwidth fraction is taken of (H100 80GB copy: 2.94e12)")
    p.add_argument("--peak-flops", type=float, default=754e12,
                   help="FLOP/s MFU is taken of (H100 bf16 GEMM: 754e12)")
    p.add_argument("--compare", choices=["hf", "vllm"], default=None,
                   help="hf (latency mode): also run transformers generate on the same "
                        "weights; vllm (throughput or serving mode): run vLLM first")
    p.add_argument("--output-json", default=None)
    add_compare_arguments(p)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs of the nano-vllm benchmark."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def _requests(args, vocab: int, max_model_len: int) -> list[tuple[list[int], int]]:
    reqs = workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    return [(p[: max_model_len - o], o) for p, o in reqs]


def run_throughput(llm, args) -> dict:
    from sluice.engine.sampling_params import SamplingParams

    reqs = _requests(args, llm.model.config.vocab_size, llm.max_model_len)
    params = [SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True, seed=i)
              for i, (_, o) in enumerate(reqs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o) for o in outs)
    n_in = sum(len(p) for p, _ in reqs)
    assert n_out == sum(o for _, o in reqs), "ignore_eos: every request runs to its length"
    # Memory floor: every decode step reads each running sequence's whole KV once, and the
    # weights at least once per step (all sequences running together: max(out) steps).
    cfg, kv_bytes = llm.model.config, llm.model.config.kv_bytes_per_token(llm.dtype.itemsize)
    kv_read = sum(o * len(p) + o * (o - 1) // 2 for p, o in reqs) * kv_bytes
    floor_s = (kv_read + max(o for _, o in reqs) * cfg.num_params * llm.dtype.itemsize) / (
        args.peak_bandwidth)
    return {"elapsed_s": elapsed, "memory_floor_s": floor_s,
            "fraction_of_floor": floor_s / elapsed, "prompt_tokens": n_in, "output_tokens": n_out,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed,
            "preemptions": llm.scheduler.num_preemptions_total}


def run_latency(llm, args) -> dict:
    from sluice.engine.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    vocab = llm.model.config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    for i in range(args.batch_size):
        llm.add_request(f"lat-{i}", [rng.randrange(vocab) for _ in range(args.input_len)], params)
    step_times = []
    first_token_s = None
    start = time.perf_counter()
    while llm.has_unfinished():
        t0 = time.perf_counter()
        outs = llm.step()
        step_times.append(time.perf_counter() - t0)
        if first_token_s is None and outs:
            first_token_s = time.perf_counter() - start
    decode = step_times[-(args.output_len - 1):] if args.output_len > 1 else []
    tpot = sum(decode) / len(decode) if decode else 0.0
    cfg, size = llm.model.config, llm.dtype.itemsize
    context = args.input_len + args.output_len // 2  # mean context of the decode steps
    step_bytes = cfg.num_params * size + args.batch_size * context * cfg.kv_bytes_per_token(size)
    prefill_flops = 2 * cfg.num_params * args.input_len * args.batch_size
    return {"ttft_ms": first_token_s * 1e3, "tpot_ms": tpot * 1e3,
            "decode_bandwidth_fraction": step_bytes / tpot / args.peak_bandwidth if tpot else 0.0,
            "prefill_mfu": prefill_flops / first_token_s / args.peak_flops,
            "batch_size": args.batch_size, "input_len": args.input_len,
            "output_len": args.output_len}


def _run_hf(config, args):
    """Measure transformers first (on a free device), then hand its weights to the engine."""
    from sluice.bench.hf_compare import build_hf_model, hf_latency, hf_weights
    from sluice.engine.loader import read_hf_config
    from sluice.engine.model_setup import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = None if config.load_format == "dummy" or config.model.endswith(".gguf") else config.model
    if config.model.endswith(".gguf"):
        raise SystemExit("--compare hf needs a Hugging Face folder or a dummy shape")
    model = build_hf_model(read_hf_config(config.model, config.load_format), path, dtype, device,
                           config.seed)
    result = hf_latency(model, args.input_len, args.output_len, args.batch_size, args.seed)
    return result, list(hf_weights(model))


def main(args: argparse.Namespace) -> int:
    from sluice.engine.llm_engine import LLMEngine

    config = engine_config(args)
    if args.mode == "serving" and args.compare != "vllm":
        raise SystemExit("--mode serving measures Sluice against vLLM: add --compare vllm")
    if args.compare == "vllm" and args.mode == "latency":
        raise SystemExit("--compare vllm: use --mode throughput or --mode serving")
    vllm_result = None
    if args.compare == "vllm":
        from sluice.bench import engine_compare
        from sluice.bench.engine_compare_procs import sigterm_exits

        with sigterm_exits():  # the vLLM processes are stopped on SIGTERM too
            if args.mode == "serving":
                return engine_compare.main_serving(config, args)
            vllm_result = engine_compare.run_vllm_offline(config, args, _requests(
                args, engine_compare.vocab_size(config), engine_compare.max_model_len(config)))
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    hf_result, weights = None, None
    if args.compare == "hf":
        if args.mode != "latency":
            raise SystemExit("--compare hf measures latency; use --mode latency")
        hf_result, weights = _run_hf(config, args)
    if args.mode == "spec":
        from sluice.bench.spec_decode import run_spec

        return _report(run_spec(config, args), config, args)
    llm = LLMEngine(config, weights=weights)
    weights = None  # the engine holds its own copy now
    try:
        result = (run_throughput(llm, args) if args.mode == "throughput"
                  else run_latency(llm, args))
    finally:
        llm.close()  # (its tensor-parallel workers, if any)
    if hf_result is not None:
        result.update({f"hf_{k}": v for k, v in hf_result.items()})
        result["ttft_ratio_ours_over_hf"] = result["ttft_ms"] / hf_result["ttft_ms"]
        result["tpot_ratio_ours_over_hf"] = result["tpot_ms"] / hf_result["tpot_ms"]
    if vllm_result is not None:
        from sluice.bench.engine_compare import offline_comparison

        result.update(offline_comparison(result, vllm_result))
    result.update(dtype=str(llm.dtype), device=str(llm.device))
    return _report(result, config, args)


def _report(result: dict, config, args) -> int:
    result.update(mode=args.mode, model=config.model,
                  machine=platform.processor() or platform.machine(),
                  date=time.strftime("%Y-%m-%d"))
    for key, value in result.items():
        print(f"{key:>16}: {value:.2f}" if isinstance(value, float) else f"{key:>16}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
