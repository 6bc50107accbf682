"""The soak's load: steady Poisson arrivals of a mixed workload, each request's outcome and
cause of failure (helper of `sluice bench soak`).

The mix, seed-fixed: 60 % chats whose system prompt is one of `groups` shared ones (prefix
reuse, so the KV-aware routing and the index work) and 40 % plain completions; 70 %
streamed; prompts of 16-192 words, 8-48 output tokens. Every request has a deadline:
one still unanswered then is a hang (cause `timeout`), the one outcome the soak's target
forbids outright.

Causes of failure:
- `http_<status>`: answered with another status before any body;
- `stream_error`: an SSE `error` event (the engine or the gateway said what went wrong);
- `stream_truncated`: the stream ended cleanly without `data: [DONE]`;
- `stream_cut`: the connection broke mid-answer (after the headers);
- `connection`: it broke, or was refused, before any answer;
- `timeout`: nothing more within the deadline;
- `bad_body`: a 200 whose JSON has no choices.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from sluice.bench.serve_workloads import TextMaker


@dataclass
class Outcome:
    start: float  # seconds since the soak began
    end: float = 0.0
    ok: bool = False
    cause: str = "ok"
    kind: str = "chat"
    stream: bool = True
    pod: str | None = None
    ttft: float | None = None  # seconds; streams only
    output_tokens: int = 0

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def row(self) -> dict[str, Any]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Mix:
    groups: int = 8
    chat_share: float = 0.6
    stream_share: float = 0.7
    prompt_words: tuple[int, int] = (16, 192)
    output_tokens: tuple[int, int] = (8, 48)


def make_body(rng: random.Random, maker: TextMaker, systems: list[str], model: str,
              mix: Mix) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request of the mix."""
    words = rng.randint(*mix.prompt_words)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(*mix.output_tokens),
                            "temperature": 0.0, "ignore_eos": True,
                            "stream": rng.random() < mix.stream_share}
    if rng.random() < mix.chat_share:
        body["messages"] = [{"role": "system", "content": rng.choice(systems)},
                            {"role": "user", "content": maker.text(max(4, words // 4))}]
        return "/v1/chat/completions", body
    body["prompt"] = maker.text(words)
    return "/v1/completions", body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], t0: float,
               timeout_s: float, open_streams: Counter | None = None) -> Outcome:
    """One request. `open_streams`: pod -> streams it is answering now, kept up to date
    while this one is (read by the soak's fault thread to pick an engine to kill)."""
    out = Outcome(start=time.monotonic() - t0, kind="chat" if "messages" in body else
                  "completion", stream=body["stream"])
    try:
        await asyncio.wait_for(_exchange(client, url, body, out, t0,
                                         Counter() if open_streams is None else open_streams),
                               timeout_s)
    except TimeoutError:
        out.ok, out.cause = False, "timeout"
    out.end = time.monotonic() - t0
    return out


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome,
                    t0: float, open_streams: Counter) -> None:
    answered = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            answered = True
            out.pod = resp.headers.get("x-sluice-pod")
            if body["stream"] and resp.status_code == 200:
                open_streams[out.pod] += 1
            try:
                await _read(resp, body, out, t0)
            finally:
                if body["stream"] and resp.status_code == 200:
                    open_streams[out.pod] -= 1
    except httpx.TimeoutException:
        out.cause = "timeout"
    except (httpx.TransportError, json.JSONDecodeError):
        out.cause = "stream_cut" if answered else "connection"


async def _read(resp: httpx.Response, body: dict[str, Any], out: Outcome, t0: float) -> None:
    if resp.status_code != 200:
        await resp.aread()
        out.cause = f"http_{resp.status_code}"
        return
    if not body["stream"]:
        data = json.loads(await resp.aread())
        out.ok = bool(data.get("choices"))
        out.cause = "ok" if out.ok else "bad_body"
        out.output_tokens = (data.get("usage") or {}).get("completion_tokens", 0)
        return
    out.cause = "stream_truncated"  # unless [DONE] comes
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.ok, out.cause = True, "ok"
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.cause = "stream_error"
            return
        if chunk.get("choices"):
            if out.ttft is None:
                out.ttft = time.monotonic() - t0 - out.start
            out.output_tokens += 1


async def drive(base_url: str, model: str, duration_s: float, rate: float, seed: int,
                timeout_s: float, t0: float, mix: Mix = Mix(), max_in_flight: int = 256,
                open_streams: Counter | None = None) -> tuple[list[Outcome], int]:
    """Poisson arrivals at `rate`/s from now until `t0 + duration_s`, then wait for every
    request (each ends by its deadline). Returns (outcomes in send order, arrivals that
    found `max_in_flight` requests already out and were not sent)."""
    rng = random.Random(seed)
    maker = TextMaker(rng)
    systems = [maker.text(rng.randint(*mix.prompt_words)) for _ in range(mix.groups)]
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=64)
    tasks: list[asyncio.Task] = []
    pending: set[asyncio.Task] = set()
    shed = 0
    # the deadline is the soak's (send's wait_for); httpx's own only bounds a stalled read
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        while (now := time.monotonic() - t0) < duration_s:
            if len(pending) >= max_in_flight:
                shed += 1
            else:
                path, body = make_body(rng, maker, systems, model, mix)
                task = asyncio.create_task(send(client, base_url + path, body, t0, timeout_s,
                                                open_streams))
                tasks.append(task)
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.sleep(min(rng.expovariate(rate), max(0.0, duration_s - now)))
        return list(await asyncio.gather(*tasks)), shed
