"""Flow control under saturation, through the whole local stack (`sluice up`: Redis,
engines, the picker, Envoy), with and without it, in one run.

    sluice bench flow [--engines 2] [--slots 8] [--seconds 40] [--high-rate 0.5]
        [--low-rates 12,8,8] [--stacks engine_priority,flow_control,no_flow_control]

Stacks (`STACKS`), one after the other, alike but for the picker's configuration and the
engines' scheduling policy: least_load's plugins plus a `concurrency-detector`
(maxConcurrency = each engine's `--max-num-seqs`, `--slots`), and `--objective
interactive=10 --objective batch=0`; `flow_control` also turns on the `flowControl` gate
(round-robin fairness between tenants, 100 queued batch requests at most,
`defaultRequestTTL` 60s, `priority-holdback-policy` minCeiling `--min-ceiling`, 0.75:
batch requests wait once 3/4 of the slots are busy, interactive ones only when all are);
`engine_priority` is flow_control with engines that schedule by the priority the picker
passes on (`--scheduling-policy priority`); `no_flow_control` has neither. Each stack
serves three phases:
- `unloaded`: interactive requests alone (priority 10), Poisson at `--high-rate`;
- `floor`: the same arrivals as `loaded`, but every batch request names a model no
  engine serves (the picker's 404): the client, Envoy and the picker work as hard,
  the engines do not. On a machine whose cores they all share, this is the interactive
  TTFT that no admission policy can beat;
- `loaded`: the same interactive stream plus batch requests (priority 0) of three
  tenants (fairness ids a, b, c), Poisson at `--low-rates` each, more than the engines
  serve, so the pool stays saturated.
Every request streams a chat completion of `--max-tokens` tokens through the openai SDK
(no retries). Reports per stack and phase: the interactive requests' TTFT p50/p90 and
floor and loaded p90 over unloaded p90; per batch tenant the requests sent, those answered while
the arrivals went on (the pool saturated) and their share of them; 429s; failures
(anything else: must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import numpy as np
import yaml

from sluice.bench.serve_workloads import TextMaker

TENANTS = ("a", "b", "c")
# name -> (the picker's flowControl gate, the engines' --scheduling-policy)
STACKS = {"engine_priority": (True, "priority"), "flow_control": (True, "fcfs"),
          "no_flow_control": (False, "fcfs")}
FLOOR_MODEL = "no-such-model"  # the floor phase's batch requests: 404 at the picker
OBJECTIVES = ("interactive=10", "batch=0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--slots", type=int, default=8,
                   help="each engine's --max-num-seqs, the detector's maxConcurrency")
    p.add_argument("--min-ceiling", type=float, default=0.75,
                   help="priority-holdback-policy's minCeiling: batch waits once this "
                        "fraction of the slots is busy")
    p.add_argument("--engine-args", default="--num-threads 1",
                   help="more `sluice engine` flags (one string)")
    p.add_argument("--seconds", type=float, default=40.0, help="each phase's length")
    p.add_argument("--high-rate", type=float, default=0.5, help="interactive requests/s")
    p.add_argument("--low-rates", default="12,8,8", help="batch requests/s of tenants a,b,c")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stacks", default=",".join(STACKS),
                   help=f"which stacks to run, in order (of {', '.join(STACKS)})")
    p.add_argument("--result-json", default=None)


def epp_config(flow: bool, slots: int, min_ceiling: float) -> dict:
    """least_load's plugins, a concurrency detector of the engines' `slots`, and (`flow`)
    flow control holding batch back at `min_ceiling` of them (priority-holdback-policy)."""
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
           "plugins": [{"type": "request-queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                       {"type": "concurrency-detector", "parameters": {
                           "maxConcurrency": slots}},
                       {"type": "priority-holdback-policy", "parameters": {
                           "minCeiling": min_ceiling}}],
           "schedulingProfiles": [{"name": "default", "plugins": [
               {"pluginRef": "request-queue-scorer", "weight": 2},
               {"pluginRef": "kv-cache-utilization-scorer", "weight": 2}]}],
           "saturationDetector": {"pluginRef": "concurrency-detector"}}
    if flow:
        doc["featureGates"] = ["flowControl"]
        doc["flowControl"] = {"defaultRequestTTL": "60s",
                              "usageLimitPolicyPluginRef": "priority-holdback-policy",
                              "priorityBands": [{"priority": 10},
                                                {"priority": 0, "maxRequests": 100}]}
    return doc


async def one(client, model: str, prompt: str, max_tokens: int, headers: dict) -> dict:
    """One streamed chat completion: its outcome and TTFT (seconds)."""
    import openai

    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=True,
            max_tokens=max_tokens, extra_headers=headers)
        ttft = None
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - start
        return {"ok": True, "ttft": ttft, "end": time.perf_counter()}
    except openai.RateLimitError:
        return {"ok": False, "status": 429}
    except openai.APIStatusError as err:
        return {"ok": False, "status": err.status_code}
    except openai.APIError as err:
        return {"ok": False, "status": type(err).__name__}


async def phase(url: str, model: str, args, loaded: bool, rng: random.Random,
                batch_model: str | None = None) -> dict:
    """One phase; `batch_model`: the batch requests' model (default `model`)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=300)
    maker = TextMaker(rng)
    streams = [("interactive", None, args.high_rate)]
    if loaded:
        streams += [("batch", t, float(r)) for t, r in
                    zip(TENANTS, args.low_rates.split(","), strict=True)]
    tasks: list[tuple[str, str | None, asyncio.Task]] = []

    async def arrivals(objective: str, tenant: str | None, rate: float) -> None:
        t = 0.0
        t0 = time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > args.seconds:
                return
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            headers = {"x-gateway-inference-objective": objective}
            if tenant:
                headers["x-gateway-inference-fairness-id"] = tenant
            to = batch_model if tenant and batch_model else model
            tasks.append((objective, tenant, asyncio.ensure_future(one(
                client, to, maker.text(args.prompt_words), args.max_tokens, headers))))

    t_start = time.perf_counter()
    await asyncio.gather(*(arrivals(*s) for s in streams))
    results = [(o, t, await task) for o, t, task in tasks]
    await client.close()
    high = [r["ttft"] for o, _, r in results if o == "interactive" and r["ok"]
            and r["ttft"] is not None]
    row = {"interactive": len([1 for o, _, _ in results if o == "interactive"]),
           "interactive_ttft_ms_p50": float(np.percentile(high, 50)) * 1000 if high else None,
           "interactive_ttft_ms_p90": float(np.percentile(high, 90)) * 1000 if high else None,
           "refused_429": sum(1 for *_, r in results if r.get("status") == 429),
           "failed": [r["status"] for o, _, r in results if not r["ok"]
                      and r.get("status") != 429 and (o == "interactive" or not batch_model)]}
    if loaded:  # (answered while arrivals went on: while the pool was saturated)
        within = t_start + args.seconds
        done = {t: sum(1 for o, tt, r in results if tt == t and r["ok"] and r["end"] <= within)
                for t in TENANTS}
        total = sum(done.values()) or 1
        row["batch_answered_in_phase"] = done
        row["batch_share"] = {t: done[t] / total for t in TENANTS}
        row["batch_sent"] = {t: sum(1 for _, tt, _ in results if tt == t) for t in TENANTS}
    return row


def run_stack(name: str, args) -> list[dict]:
    from sluice.local.stack import LocalStack, StackConfig, free_port

    flow, policy = STACKS[name]
    path = os.path.join(tempfile.mkdtemp(prefix="sluice-flow-"), "epp.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(epp_config(flow, args.slots, args.min_ceiling), f)
    gateway = ["--config", path, *(f"--objective={o}" for o in OBJECTIVES)]
    engine_args = (*args.engine_args.split(), "--max-num-seqs", str(args.slots),
                   "--scheduling-policy", policy)
    stack = LocalStack(StackConfig(engines=args.engines, routing="least_load",
                                   port=free_port(), engine_args=engine_args,
                                   gateway_args=tuple(gateway), log_level="warning"),
                       out=sys.stderr)
    rows = []
    try:
        stack.start()
        import httpx
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        asyncio.run(phase(stack.url, model, argparse.Namespace(
            **{**vars(args), "seconds": 3.0, "high_rate": 2.0}), False, random.Random(1)))
        for label, loaded, batch_model in (("unloaded", False, None),
                                           ("floor", True, FLOOR_MODEL),
                                           ("loaded", True, None)):
            load = os.getloadavg()[0]
            row = {"stack": name, "phase": label, **asyncio.run(
                phase(stack.url, model, args, loaded, rng, batch_model)),
                "loadavg_1m": [load, os.getloadavg()[0]]}
            if batch_model:  # (every batch request is the picker's 404: no engine work)
                row.pop("batch_answered_in_phase", None)
                row.pop("batch_share", None)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        stack.stop()
    unloaded = rows[0]
    for row in rows[1:]:
        if unloaded["interactive_ttft_ms_p90"] and row["interactive_ttft_ms_p90"]:
            row["interactive_p90_over_unloaded"] = (row["interactive_ttft_ms_p90"]
                                                    / unloaded["interactive_ttft_ms_p90"])
    return rows


def main(args: argparse.Namespace) -> int:
    names = args.stacks.split(",")
    if unknown := set(names) - set(STACKS):
        raise SystemExit(f"--stacks: unknown {sorted(unknown)} (of {', '.join(STACKS)})")
    print(f"stacks: {', '.join(names)}: {args.engines} engines ({args.engine_args} "
          f"--max-num-seqs {args.slots} --scheduling-policy fcfs, or priority for "
          f"engine_priority); "
          f"picker: least_load's scorers, concurrency-detector maxConcurrency {args.slots}, "
          f"objectives {', '.join(OBJECTIVES)}; flow_control adds featureGates "
          f"[flowControl] (round-robin tenants, batch band 100 requests, TTL 60s, "
          f"priority-holdback-policy minCeiling {args.min_ceiling}: batch waits at that "
          f"fraction of the slots)")
    rows = [row for name in names for row in run_stack(name, args)]
    for r in rows:
        print(json.dumps(r))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
