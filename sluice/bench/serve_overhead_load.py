"""The two ends of `serve_overhead`'s measurement: an instant OpenAI-shaped upstream
(answers every completion at once, so only the HTTP path is measured) and the client
that sends completions to a path on a fixed Poisson schedule; and `Run`, one path's
measured parts pooled."""

from __future__ import annotations

import asyncio
import json
import os
import random
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
            except (TimeoutError, aiohttp.ClientError):
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


class Run:
    """One path's measured parts, pooled: latencies, failures, time, and the CPU and
    routing histograms of its processes over exactly those requests. `path` has the
    path's `url`, and where it has them the `pid` of its routing process, the URL of
    that process's `metrics` and its `envoy` (an `EnvoyProcess`)."""

    def __init__(self, path) -> None:
        self.path = path
        self.lat: list[np.ndarray] = []
        self.failed = 0
        self.seconds = 0.0
        self.cpu_s = [0.0, 0.0]  # the routing process's, Envoy's (includes their background)
        self.sums: dict[str, tuple[float, float]] = {}

    def measure(self, prompts: list[str], rate: float, seed: int) -> None:
        path = self.path
        pids = (path.pid, path.envoy.proc.pid if path.envoy else None)
        before = _gateway_sums(path.metrics) if path.metrics else {}
        cpu0 = [_cpu_s(pid) if pid else None for pid in pids]
        lat, failed, achieved = asyncio.run(drive(path.url, prompts, rate, seed))
        for i, (pid, t0) in enumerate(zip(pids, cpu0, strict=True)):
            t1 = _cpu_s(pid) if pid else None
            if t0 is not None and t1 is not None:
                self.cpu_s[i] += t1 - t0
        if path.metrics:
            for base, (total, count) in _gateway_sums(path.metrics).items():
                total0, count0 = before.get(base, (0.0, 0.0))
                acc = self.sums.get(base, (0.0, 0.0))
                self.sums[base] = (acc[0] + total - total0, acc[1] + count - count0)
        self.lat.append(lat)
        self.failed += failed
        self.seconds += len(prompts) / achieved

    def report(self, name: str, direct: Run, n: int) -> dict[str, object]:
        lat, direct_lat = np.concatenate(self.lat), np.concatenate(direct.lat)
        out = {f"{name}_failed": self.failed, f"{name}_achieved_rate": n / self.seconds}
        for q in (50, 90, 99):
            out[f"{name}_ms_p{q}"] = float(np.percentile(lat, q))
            if self is not direct:
                out[f"{name}_overhead_ms_p{q}"] = out[f"{name}_ms_p{q}"] - float(
                    np.percentile(direct_lat, q))
        if self is not direct:
            out[f"{name}_overhead_ms_p50_by_round"] = [
                float(np.percentile(a, 50) - np.percentile(b, 50))
                for a, b in zip(self.lat, direct.lat, strict=True)]
        for base, (total, count) in self.sums.items():
            key = base.removeprefix("sluice_gateway_").removesuffix("_seconds")
            out[f"{name}_gateway_{key}_ms_mean"] = 1000 * total / max(1.0, count)
        if self.path.pid:
            out[f"{name}_cpu_ms_per_request"] = 1000 * self.cpu_s[0] / n
        if self.path.envoy:
            out[f"{name}_envoy_cpu_ms_per_request"] = 1000 * self.cpu_s[1] / n
        return out
