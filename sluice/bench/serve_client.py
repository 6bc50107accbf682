"""Send workload requests to an OpenAI endpoint (streaming) and time them.

Arrivals: a Poisson process at `request_rate` (inf: all at once), capped by
`max_concurrency` requests in flight. Multi-turn sessions start as a Poisson
process and send their turns one after another, each turn carrying the whole
conversation so far.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.bench.serve_workloads import Request


@dataclass
class Result:
    ok: bool
    start: float
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    pod: str | None = None
    pd: str | None = None  # the picker's P/D decision (x-sluice-pd), when it made one
    hit_blocks: int | None = None
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client: httpx.AsyncClient, base_url: str, model: str, req: Request,
               messages: list[dict[str, Any]] | None = None) -> Result:
    body: dict[str, Any] = {"model": req.model or model, "max_tokens": req.max_tokens,
                            "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": 0.0}
    if req.kind == "chat":
        body["messages"] = messages if messages is not None else req.messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/v1/completions"
    res = Result(ok=False, start=time.perf_counter())
    last = res.start
    chunks = 0
    try:
        async with client.stream("POST", base_url + path, json=body) as resp:
            res.pod = resp.headers.get("x-sluice-pod")
            res.pd = resp.headers.get("x-sluice-pd")
            hb = resp.headers.get("x-sluice-prefix-hit-blocks")
            res.hit_blocks = int(hb) if hb is not None else None
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                    res.output_tokens = data["usage"].get("completion_tokens", 0)
                choices = data.get("choices") or []
                if not choices:
                    continue
                # as vLLM's bench: every chunk with choices is a token event, even
                # with empty text (a special token), and times TTFT / ITL / E2E
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - res.start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                for choice in choices:
                    res.text += choice.get("text") or (choice.get("delta") or {}).get(
                        "content") or ""
        res.ok = res.ttft is not None
        res.output_tokens = res.output_tokens or chunks
        if not res.ok:
            res.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        res.error = f"{type(err).__name__}: {err}"
    finally:
        # E2E ends at the last token chunk (not the usage chunk or [DONE] after it)
        res.e2e = (last if res.ok else time.perf_counter()) - res.start
    return res


async def run(requests: list[Request], base_url: str, model: str, request_rate: float,
              max_concurrency: int | None, seed: int, progress: Any = None,
              timeout_s: float = 600.0, headers: dict[str, str] | None = None
              ) -> tuple[list[Result], float]:
    """Send every request (multi-turn: every turn); returns (results, duration in s)."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or 1_000_000)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=max_concurrency or 1000,
                          max_keepalive_connections=max_concurrency or 1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits,
                                 headers=headers) as client:

        async def one(req: Request) -> None:
            if req.session < 0:
                async with limit:
                    results.append(await send(client, base_url, model, req))
                if progress is not None:
                    progress.update(1)
                return
            messages = list(req.messages or [])
            for turn, q in enumerate(req.questions):
                messages.append({"role": "user", "content": q})
                async with limit:
                    res = await send(client, base_url, model, req, messages)
                results.append(res)
                if progress is not None:
                    progress.update(1)
                if not res.ok:  # the session cannot go on: its later turns fail too
                    skipped = len(req.questions) - turn - 1
                    results.extend(Result(ok=False, start=res.start, error="session ended "
                                          "by an earlier failed turn") for _ in range(skipped))
                    if progress is not None:
                        progress.update(skipped)
                    return
                messages.append({"role": "assistant", "content": res.text})

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start
