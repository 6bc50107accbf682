"""The two ends of `serve_overhead`'s measurement: an instant OpenAI-shaped upstream
(answers every completion at once, so only the HTTP path is measured) and the client
that sends completions to a path on a fixed Poisson schedule."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
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
