"""`sluice bench lora`: serving with LoRA adapters against the base model alone, one run.

One server, started with --enable-lora (--max-loras = --num-adapters, rank
--lora-rank), measures in order:
1. each adapter's load through `POST /v1/load_lora_adapter` (wall time) and the
   server's resident memory before and after (all its processes), per adapter;
2. a warm-up, then the base phase: `--requests` streaming completions naming the base
   model, `--concurrency` in flight;
3. the LoRA phase: as many requests, with prompts of their own, naming the adapters in
   turn (evenly mixed).
The drop is 1 - LoRA tok/s / base tok/s. Workload: the serving comparison's (50-400
random words in, 50-200 tokens out with ignore_eos, greedy, seed-fixed). Adapters:
seeded random PEFT folders over every projection (lora_adapters.py), the same files for
both engines. `--compare vllm` runs the same on vLLM first (`--enable-lora`,
VLLM_ALLOW_RUNTIME_LORA_UPDATING), one engine at a time, with the cores of each
`--thread-setups` entry (engine_compare_threads.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sluice.bench import engine_compare as compare
from sluice.bench import engine_compare_threads as threads
from sluice.bench.engine_compare_procs import Server, start_sluice, start_vllm
from sluice.bench.serve_client import run
from sluice.bench.serve_stats import summarize
from sluice.bench.serve_workloads import Request, TextMaker

KEY = "sluice-bench-lora"  # both servers' API key (the load endpoints need one)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sluice.engine.cli import add_arguments as add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="per phase")
    p.add_argument("--compare", choices=["vllm"], default=None)
    p.add_argument("--output-json", default=None)
    compare.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    from sluice.bench.lora_adapters import write_random_adapters
    from sluice.engine.cli import engine_config
    from sluice.engine.config import ModelConfig
    from sluice.engine.loader import read_hf_config

    config = engine_config(args)
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-lora-"))
    print(f"logs and adapters: {log_dir}", file=sys.stderr, flush=True)
    cfg = ModelConfig.from_hf(read_hf_config(config.model, config.load_format))
    adapters = write_random_adapters(cfg, log_dir / "adapters", args.num_adapters,
                                     args.lora_rank, args.seed)
    workload = compare.serving_workload(2 * args.requests, args.seed)
    names = list(adapters)
    lora_reqs = [Request(r.kind, r.max_tokens, r.prompt, model=names[i % len(names)])
                 for i, r in enumerate(workload[args.requests:])]
    phases = {"base": workload[:args.requests], "lora": lora_reqs}
    usable = threads.usable_cpu_ids()
    engines = ["vllm", "sluice"] if args.compare else ["sluice"]
    preload = threads.vllm_preload(compare.vllm_python(args)) if args.compare else None
    results = []
    for name in threads.parse_setups(args.thread_setups):
        setup = threads.setup(name, args.num_threads, compare.vllm_env(args.vllm_env), usable,
                              preload)
        row = {"threads": setup.name, "binding": setup.describe(usable)}
        for engine in engines:
            server = _start(engine, config, args, log_dir / f"{engine}-{setup.name}", setup)
            try:
                server.wait_ready(args.vllm_timeout if engine == "vllm" else 600.0)
                row[engine] = _measure(server, config.served_model_name, adapters, phases,
                                       args)
            finally:
                server.stop()
            print(engine, json.dumps(row[engine]), file=sys.stderr, flush=True)
        results.append(row)
    report = {"model": config.model, "date": time.strftime("%Y-%m-%d"),
              "load_avg_at_end": os.getloadavg()[0], "num_adapters": args.num_adapters,
              "rank": args.lora_rank, "concurrency": args.concurrency,
              "requests_per_phase": args.requests, "setups": results}
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


def _start(engine: str, config, args, log_dir: Path, setup: threads.ThreadSetup) -> Server:
    log_dir.mkdir(parents=True)
    n, rank = str(args.num_adapters), str(args.lora_rank)
    if engine == "sluice":
        argv = compare.engine_argv(args, without=(
            "num_threads", "enable_lora", "lora_modules", "max_loras", "max_lora_rank",
            "max_cpu_loras", "api_key"))
        return start_sluice([*argv, "--num-threads", str(setup.sluice_threads), "--api-key",
                             KEY, "--enable-lora", "--max-loras", n, "--max-lora-rank", rank],
                            log_dir)
    env = {**setup.vllm_env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_API_KEY": KEY}
    return start_vllm(compare.vllm_python(args), compare.vllm_model_dir(config, args), log_dir,
                      dtype=compare.dtype_name(config),
                      max_model_len=compare.max_model_len(config), seed=config.seed,
                      served_name=config.served_model_name,
                      kv_space_gib=compare.kv_space_gib(config),
                      extra_args=["--enable-lora", "--max-loras", n, "--max-lora-rank", rank,
                                  *shlex.split(args.vllm_args)], extra_env=env)


def _measure(server: Server, model: str, adapters: dict[str, Path],
             phases: dict[str, list[Request]], args) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    pid = server.process.child.proc.pid
    rss_before = _group_rss(pid)
    load_ms = []
    for name, path in adapters.items():
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/load_lora_adapter", headers=headers, timeout=300,
                       json={"lora_name": name, "lora_path": str(path)})
        load_ms.append((time.perf_counter() - t0) * 1e3)
        if r.status_code != 200:
            raise SystemExit(f"{server.name}: loading {name} failed: {r.status_code} {r.text}")
    rss_after = _group_rss(pid)
    warm = [Request("completion", 4, prompt=TextMaker(random.Random(args.seed + 1)).text(8),
                    model=m) for m in (model, *adapters)]
    asyncio.run(run(warm, server.url, model, float("inf"), 2, args.seed, headers=headers))
    out = {"adapter_load_ms": [round(x, 1) for x in load_ms],
           "rss_mib_per_adapter": round((rss_after - rss_before) / len(adapters) / 2**20, 1)}
    for phase, reqs in phases.items():
        results, duration = asyncio.run(run(reqs, server.url, model, float("inf"),
                                            args.concurrency, args.seed, headers=headers))
        s = summarize(results, duration)
        out[phase] = {"out_tok_s": round(s["output_throughput"], 1),
                      "ttft_p50_ms": round(s["ttft_ms"]["p50"]),
                      "ttft_p90_ms": round(s["ttft_ms"]["p90"]),
                      "tpot_p50_ms": round(s["tpot_ms"]["p50"], 1), "failed": s["failed"]}
    out["drop"] = round(1 - out["lora"]["out_tok_s"] / out["base"]["out_tok_s"], 3)
    return out


def _group_rss(pgid: int) -> int:
    """Resident bytes of every process in the process group (the server and its engines)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid:  # (field 5, pgrp, after the command's parentheses)
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # (field 24, rss)
        except (OSError, ValueError, IndexError):
            continue
    return total
