"""Issue 18's benchmark through the whole local stack (Envoy, the picker, Redis, engines: what
`sluice up` starts, `sluice.local.stack`): aggregated against disaggregated, in one run.

    python -m sluice.bench.pd_interference --through-stack --prompt-len 2000

Two stacks, one after the other, each serving the same workload in two phases:
  aggregated     `--stack-engines` N engines (kv_aware): whichever engine a long prompt
                 lands on prefills it between its streams' decode steps;
  disaggregated  the same N engines split into `--stack-prefill` P prefill engines and N-P
                 decode engines: the picker sends every request to a decode engine and, for
                 a prompt with >= its threshold of uncached tokens, names a prefill engine
                 in `x-prefiller-host-port` (`sluice.gateway.routing.pd`).
Each shape's phases: `<shape>-baseline` (S steady chat streams only) then `<shape>` (the
streams plus long completion prompts at Poisson `--rate`). The loaded phases of both shapes
draw the same arrival times and the same prompts (one seed). Before its phases each stack
serves one long prompt and one stream, so first-use costs land in no phase.

Reports per phase (`pd_stack_stats`): the streams' ITL p50/p99 and p99 over the same
shape's baseline, their token throughput, the long prompts' TTFT and, disaggregated, the
pull's mean time, size and share of that TTFT (the decode engines' kv-transfer metrics),
fallbacks and failed prefill legs, and the picker's decisions (x-sluice-pd).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import httpx

from sluice.bench.pd_stack_stats import add_ratios, format_table, metric_sum, phase_row
from sluice.bench.serve_client import Result, send
from sluice.bench.serve_workloads import Request, TextMaker

# decode engines' counters read before and after a phase: field -> (metric, label)
TRANSFER = {"pull_seconds": ("sluice:kv_transfer_time_seconds_sum", 'direction="received"'),
            "pulls": ("sluice:kv_transfer_time_seconds_count", 'direction="received"'),
            "bytes": ("sluice:kv_transfer_bytes_total", 'direction="received"'),
            "fallbacks": ("sluice:kv_transfer_fallbacks_total", ""),
            "leg_failures": ("sluice:kv_transfer_prefill_leg_failures_total", "")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--through-stack", action="store_true",
                   help="the whole local stack (Envoy + picker + Redis + engines), "
                        "aggregated then disaggregated (sluice.bench.pd_stack)")
    p.add_argument("--stack-engines", type=int, default=2, help="--through-stack: N engines")
    p.add_argument("--stack-prefill", type=int, default=1,
                   help="--through-stack: of which prefill engines when disaggregated")
    p.add_argument("--long-tokens", type=int, default=8, help="long prompts' output tokens")
    p.add_argument("--gateway-args", default="", help="--through-stack: extra picker flags")
    p.add_argument("--result-json", default=None)


def _stream_request(i: int, k: int, tokens: int) -> Request:
    """A short chat (well under the picker's P/D threshold): decode-heavy."""
    return Request("chat", tokens, messages=[{"role": "user", "content":
                   f"Stream {i}, request {k}: tell me a long story about the sea."}])


def long_prompts(seed: int, words: int, n: int) -> list[str]:
    """`n` distinct prompts of `words` common words (no shared prefix beyond chance)."""
    maker = TextMaker(random.Random(seed))
    return [maker.text(words) for _ in range(n)]


async def run_phase(url: str, model: str, args: argparse.Namespace, prompts: list[str],
                    gaps: list[float]) -> tuple[list[Result], list[Result], float, float]:
    """S streams from now; after `warmup_s` the window [t0, t1) of `phase_s`, during which
    `prompts[i]` is sent `gaps[i]` seconds after the previous one (none: a baseline). Streams
    start no request after t1; returns once everything sent has finished."""
    streams: list[Result] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter() + args.warmup_s
        t1 = t0 + args.phase_s

        async def stream(i: int) -> None:
            k = 0
            while time.perf_counter() < t1:
                res = await send(client, url, model, _stream_request(i, k, args.stream_tokens))
                streams.append(res)
                k += 1
                if not res.ok:
                    await asyncio.sleep(0.5)  # no tight loop on a failing gateway

        async def arrivals() -> list[Result]:
            await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
            tasks = []
            for prompt, gap in zip(prompts, gaps):
                await asyncio.sleep(gap)
                if time.perf_counter() >= t1:
                    break
                tasks.append(asyncio.create_task(send(client, url, model, Request(
                    "completion", args.long_tokens, prompt=prompt))))
            return list(await asyncio.gather(*tasks))

        done = await asyncio.gather(arrivals(), *(stream(i) for i in range(args.streams)))
    return streams, done[0], t0, t1


async def _warm_up(url: str, model: str, prompt: str) -> None:
    """One long prompt and one stream at once (first-use costs: kernels, the transfer)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        for res in await asyncio.gather(
                send(client, url, model, Request("completion", 4, prompt=prompt)),
                send(client, url, model, _stream_request(-1, 0, 8))):
            if not res.ok:
                raise RuntimeError(f"warm-up request failed: {res.error}")


def _scrape(urls: list[str]) -> dict[str, float]:
    texts = [httpx.get(u + "/metrics", timeout=10).text for u in urls]
    return {k: sum(metric_sum(t, name, label) for t in texts)
            for k, (name, label) in TRANSFER.items()}


def _calibrate(model: str, prompt_len: int) -> int:
    """Words of `TextMaker` text that make ~`prompt_len` tokens for the model's tokenizer."""
    from sluice.default_model import resolve_model
    from sluice.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model(model))
    sample = long_prompts(-1, 400, 1)[0]
    return max(1, round(prompt_len * 400 / len(tok.encode(sample))))


def run_shape(args: argparse.Namespace, shape: str, words: int,
              say: Any) -> list[dict[str, Any]]:
    """Start the stack of `shape` ("aggregated" | "disaggregated"), run its two phases,
    stop it; the phases' rows."""
    import shlex

    from sluice.local.stack import LocalStack, StackConfig, free_port

    n, p = args.stack_engines, args.stack_prefill
    split = {"prefill": p, "decode": n - p} if shape == "disaggregated" else {"engines": n}
    stack = LocalStack(StackConfig(**split, model=args.model, routing="kv_aware",
                                   port=free_port(), engine_args=tuple(args.engine_args),
                                   gateway_args=tuple(shlex.split(args.gateway_args)),
                                   log_level="warning"), out=sys.stderr)
    rows = []
    try:
        stack.start()
        decode = [u for u in stack.engine_urls if u not in stack.prefill_urls]
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        say(f"{shape}: {stack.url}, engines {stack.engine_urls}; warming up")
        asyncio.run(_warm_up(stack.url, model, long_prompts(args.seed + 1, words, 1)[0]))
        rng = random.Random(args.seed)  # the same arrivals and prompts for both shapes
        count = max(1, int(3 * args.rate * args.phase_s) + 5)
        arrivals = [0.0] + [rng.expovariate(args.rate) for _ in range(count - 1)]
        for phase, loaded in ((f"{shape}-baseline", False), (shape, True)):
            before = _scrape(decode)
            load = os.getloadavg()[0]
            streams, longs, t0, t1 = asyncio.run(run_phase(
                stack.url, model, args, long_prompts(args.seed, words, count) if loaded else [],
                arrivals if loaded else []))
            after = _scrape(decode)
            delta = {k: after[k] - before[k] for k in after}
            row = phase_row(phase, shape, streams, longs, t0, t1,
                            delta if shape == "disaggregated" else None)
            row["loadavg_1m"] = [load, os.getloadavg()[0]]
            rows.append(row)
            say(json.dumps(row))
    finally:
        stack.stop()
    return rows


def main(args: argparse.Namespace) -> int:
    """Both shapes in one run; prints each phase's JSON, then the table. Exit 1 when a
    request failed or a shape's baseline is missing."""
    def say(text: str) -> None:
        print(text, flush=True)

    assert 1 <= args.stack_prefill < args.stack_engines, "--stack-prefill: 1 to N-1"
    words = _calibrate(args.model, args.prompt_len)
    say(json.dumps({"long_prompt_words": words, "loadavg": os.getloadavg(),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    rows = [row for shape in ("aggregated", "disaggregated")
            for row in run_shape(args, shape, words, say)]
    add_ratios(rows)
    say(format_table(rows))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2, default=str)
    failed = sum(r["stream_errors"] + r["long_sent"] - r["long_done"] for r in rows)
    return 0 if failed == 0 and all(r["p99_vs_baseline"] for r in rows) else 1
