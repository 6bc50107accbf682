"""`sluice bench serve`: drive an OpenAI endpoint with a workload, like `vllm bench serve`.

Reports TTFT, TPOT, ITL, E2E (mean, p50, p90, p99), request and token
throughput, and the prefix-cache hit rate read from the engines' metrics
(`vllm:prefix_cache_hits_total / queries_total`, delta over the run). JSON
results (`--result-json`) and a PNG (`--plot`). `--compare s1,s2,...` starts a
local stack (`--engines`, `--model`) and runs the same workload once per
routing strategy, restarting the engines (empty caches) and flushing Redis
between runs, then prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import sys
import time
from typing import Any

from sluice.bench.serve_client import Result, run
from sluice.bench.serve_stats import (
    detailed,
    engine_urls_behind,
    format_table,
    scrape_prefix_counters,
    summarize,
)
from sluice.bench.serve_workloads import (
    Request,
    TextMaker,
    ideal_hit_tokens,
    multi_turn_workload,
    random_workload,
    shared_prefix_workload,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the endpoint's first)")
    p.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn"),
                   default="shared-prefix")
    p.add_argument("--num-prompts", type=int, default=100, help="random")
    p.add_argument("--input-len", type=int, default=256, help="random")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--groups", type=int, default=8, help="shared-prefix")
    p.add_argument("--users", type=int, default=8, help="shared-prefix: users per group")
    p.add_argument("--system-len", type=int, default=512, help="shared-prefix / multi-turn")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--sessions", type=int, default=16, help="multi-turn")
    p.add_argument("--turns", type=int, default=4, help="multi-turn")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="for the ideal hit rate (HF folder / .gguf; default: --stack-model's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--engine-metrics", action="append", default=[],
                   help="engine base URL for hit-rate metrics (default: from gateway /health)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--save-detailed", action="store_true",
                   help="--result-json also lists every request (send time, TTFT, E2E, "
                        "tokens, pod, predicted hit blocks, error)")
    p.add_argument("--plot", default=None, help="PNG path")
    p.add_argument("--compare", default=None,
                   help="comma-separated strategies, run on a local stack")
    p.add_argument("--engines", type=int, default=4, help="--compare: engines")
    p.add_argument("--stack-model", default="default", help="--compare: engine model")
    p.add_argument("--engine-args", default="", help="--compare: extra engine flags")
    p.add_argument("--gateway-args", default="", help="--compare: extra gateway flags")
    p.add_argument("--stack-port", type=int, default=8000, help="--compare: gateway port")
    p.add_argument("--no-progress", action="store_true")


def build_workload(args: argparse.Namespace) -> list[Request]:
    maker = TextMaker(random.Random(args.seed))
    if args.workload == "random":
        return random_workload(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, maker)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.groups, args.users, args.system_len,
                                      args.question_len, args.output_len, maker)
    return multi_turn_workload(args.sessions, args.turns, args.system_len, args.question_len,
                               args.output_len, maker)


def _first_model(base_url: str) -> str:
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def run_once(args: argparse.Namespace, base_url: str, requests: list[Request],
             label: str, ideal: float | None) -> tuple[dict[str, Any], list[Result]]:
    model = args.model or _first_model(base_url)
    engines = args.engine_metrics or engine_urls_behind(base_url)
    before = scrape_prefix_counters(engines)
    total = len(requests) * (args.turns if args.workload == "multi-turn" else 1)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm
        progress = tqdm(total=total, desc=label, file=sys.stderr)
    results, duration = asyncio.run(run(requests, base_url, model, args.request_rate,
                                        args.max_concurrency, args.seed, progress))
    if progress is not None:
        progress.close()
    after = scrape_prefix_counters(engines)
    summary = summarize(results, duration)
    summary["hit_rate"] = None
    if before is not None and after is not None and after[1] > before[1]:
        summary["hit_rate"] = (after[0] - before[0]) / (after[1] - before[1])
    summary["ideal_hit_rate"] = ideal
    summary["model"] = model
    return summary, results


def _ideal(args: argparse.Namespace, requests: list[Request]) -> float | None:
    if args.workload == "multi-turn":
        return None
    path = args.tokenizer
    if path is None and args.compare:
        from sluice.default_model import resolve_model
        path = resolve_model(args.stack_model)
    if path is None:
        return None
    from sluice.tokenizer import Tokenizer

    hit, total = ideal_hit_tokens(requests, Tokenizer.from_path(path), args.block_size)
    return hit / total if total else None


def main(args: argparse.Namespace) -> int:
    requests = build_workload(args)
    ideal = _ideal(args, requests)
    runs: dict[str, tuple[dict[str, Any], list[Result]]] = {}
    if args.compare:
        from sluice.local.stack import LocalStack, StackConfig

        strategies = [s.strip() for s in args.compare.split(",") if s.strip()]
        stack = LocalStack(StackConfig(engines=args.engines, model=args.stack_model,
                                       routing=strategies[0], port=args.stack_port,
                                       engine_args=tuple(shlex.split(args.engine_args)),
                                       gateway_args=tuple(shlex.split(args.gateway_args)),
                                       log_level="warning"), out=sys.stderr)
        try:
            stack.start()
            for i, strategy in enumerate(strategies):
                if i:
                    stack.stop_gateway()
                    stack.start_engines()  # empty caches: every strategy starts equal
                    stack.flush_redis()
                    stack.start_gateway(strategy)
                runs[strategy] = run_once(args, stack.url, requests, strategy, ideal)
        finally:
            stack.stop()
    else:
        runs["run"] = run_once(args, args.base_url.rstrip("/"), requests, "run", ideal)
    print(format_table({k: v[0] for k, v in runs.items()}))
    if ideal is not None:
        print(f"ideal prefix-cache hit rate of this workload: {100 * ideal:.1f}%")
    meta = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": platform.platform(), "requests": len(requests)}
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"meta": meta, "runs": {
                k: {**v[0], "requests": detailed(v[1])} if args.save_detailed else v[0]
                for k, v in runs.items()}}, f, indent=2, default=str)
    if args.plot:
        from sluice.bench.serve_plot import plot_runs

        plot_runs(args.plot, runs, f"{args.workload}: {len(requests)} requests")
    return 0 if all(v[0]["failed"] == 0 for v in runs.values()) else 1
