"""Summaries of a serving run: latency percentiles, throughput, prefix-cache hit rate."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import numpy as np

from sluice.bench.serve_client import Result

PERCENTILES = (50, 90, 99)


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values) * 1000.0  # ms
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p))
                                          for p in PERCENTILES}}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    hits = [r.hit_blocks for r in ok if r.hit_blocks is not None]
    pods: dict[str, int] = {}
    for r in ok:
        if r.pod:
            pods[r.pod] = pods.get(r.pod, 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_ms": _dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "e2e_ms": _dist([r.e2e for r in ok]),
        "predicted_hit_blocks_mean": float(np.mean(hits)) if hits else None,
        "requests_per_pod": pods,
    }


def detailed(results: list[Result]) -> list[dict[str, Any]]:
    """One record per request, in send order (`--save-detailed`): send time from the
    first send, TTFT and E2E in ms, tokens, the pod and predicted hit blocks the
    gateway reported, the error if it failed."""
    t0 = min((r.start for r in results), default=0.0)
    return [{"start_s": r.start - t0, "ok": r.ok,
             "ttft_ms": None if r.ttft is None else 1000.0 * r.ttft,
             "e2e_ms": 1000.0 * r.e2e, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "pod": r.pod, "hit_blocks": r.hit_blocks,
             "error": r.error} for r in sorted(results, key=lambda r: r.start)]


def scrape_prefix_counters(engine_urls: list[str]) -> tuple[float, float] | None:
    """Sum of (vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total) over
    engines; None (with a warning) when an engine does not answer: a sum over some
    of them would misstate the hit rate."""
    hits = queries = 0.0
    for url in engine_urls:
        try:
            text = httpx.get(url.rstrip("/") + "/metrics", timeout=5).text
        except httpx.HTTPError as err:
            print(f"warning: {url}/metrics: {type(err).__name__}: hit rate unknown",
                  file=sys.stderr, flush=True)
            return None
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def engine_urls_behind(base_url: str) -> list[str]:
    """Engines behind a Sluice gateway (its /health lists pods), else the URL itself."""
    try:
        pods = httpx.get(base_url + "/health", timeout=5).json().get("pods")
    except (httpx.HTTPError, ValueError, AttributeError):
        pods = None
    return [f"http://{p}" for p in pods] if pods else [base_url]


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per run (strategy), vllm-bench-like columns."""
    cols = [("req/s", lambda s: f"{s['request_throughput']:.2f}"),
            ("out tok/s", lambda s: f"{s['output_throughput']:.1f}"),
            ("TTFT p50", lambda s: f"{s['ttft_ms']['p50']:.0f}"),
            ("TTFT p90", lambda s: f"{s['ttft_ms']['p90']:.0f}"),
            ("TTFT p99", lambda s: f"{s['ttft_ms']['p99']:.0f}"),
            ("TPOT p50", lambda s: f"{s['tpot_ms']['p50']:.1f}"),
            ("E2E p90", lambda s: f"{s['e2e_ms']['p90']:.0f}"),
            ("hit rate", lambda s: "-" if s.get("hit_rate") is None
             else f"{100 * s['hit_rate']:.1f}%"),
            ("ok/fail", lambda s: f"{s['completed']}/{s['failed']}")]
    head = f"{'run':<12}" + "".join(f"{name:>11}" for name, _ in cols)
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        lines.append(f"{name:<12}" + "".join(f"{fn(s):>11}" for _, fn in cols))
    return "\n".join(lines) + "\n(latencies in ms)"
