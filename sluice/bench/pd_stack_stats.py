"""Pure bookkeeping of the P/D benchmark through the stack (`pd_stack.py`): no I/O.

A phase runs S steady decode streams (each keeps one chat completion in flight) and,
in its loaded variant, long prompts at a Poisson rate. Only what happens inside the
phase's measurement window [t0, t1) counts (the streams' ramp-up before it and the
stragglers after it do not):

- a stream's inter-token gap counts when the token that ends it arrives in the window
  (`window_gaps`); its tokens in the window make the decode throughput (`window_tokens`);
- a long prompt counts when it was sent in the window (every one is, by construction).

Token times are rebuilt from a `serve_client.Result`: start + TTFT, then + each ITL.
Percentiles are nearest-rank on the sorted values (p99 of 100 gaps: the 99th). A long
prompt prefilled between a stream's decode steps is one long gap among hundreds of short
ones, so p99 can miss it; the row also gives p99.9, the longest gap, and `stalls`: gaps of at
least STALL_S.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from sluice.bench.serve_client import Result

STALL_S = 1.0  # a gap this long is a stall: a decode step waited for a whole prefill


def token_times(res: Result) -> list[float]:
    """Arrival time of each of `res`'s token chunks (perf_counter seconds); [] without any."""
    if res.ttft is None:
        return []
    t = res.start + res.ttft
    out = [t]
    for gap in res.itl:
        t += gap
        out.append(t)
    return out


def window_gaps(results: Iterable[Result], t0: float, t1: float) -> list[float]:
    """Every inter-token gap (s) whose closing token arrived in [t0, t1)."""
    gaps = []
    for res in results:
        times = token_times(res)
        gaps += [b - a for a, b in itertools.pairwise(times) if t0 <= b < t1]
    return gaps


def window_tokens(results: Iterable[Result], t0: float, t1: float) -> int:
    """Token chunks that arrived in [t0, t1)."""
    return sum(t0 <= t < t1 for res in results for t in token_times(res))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank q-th percentile (0 < q <= 100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def metric_sum(text: str, name: str, label: str = "") -> float:
    """Sum of the samples of `name` in a Prometheus text page whose line holds `label`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


def phase_row(phase: str, shape: str, streams: list[Result], longs: list[Result],
              t0: float, t1: float, transfer: dict[str, float] | None = None) -> dict[str, Any]:
    """One phase's figures. `transfer`: the decode engines' counter deltas over the phase
    (pull_seconds, pulls, bytes, fallbacks, leg_failures), absent for aggregated shapes."""
    gaps = window_gaps(streams, t0, t1)
    done = [r for r in longs if r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    span = t1 - t0
    row: dict[str, Any] = {
        "phase": phase, "shape": shape, "window_s": span,
        "itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_p999_ms": 1000 * percentile(gaps, 99.9),
        "itl_max_ms": 1000 * max(gaps) if gaps else math.nan,
        "stalls": sum(g >= STALL_S for g in gaps), "gaps": len(gaps), "stream_tok_s": window_tokens(streams, t0, t1) / span,
        "stream_errors": sum(not r.ok for r in streams),
        "long_sent": len(longs), "long_done": len(done),
        "long_prompt_tokens": (sum(r.prompt_tokens for r in done) / len(done)) if done else None,
        "long_ttft_s": (sum(ttfts) / len(ttfts)) if ttfts else None,
        "long_ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "pd": dict(Counter(r.pd or "none" for r in longs)),
        "stream_pd": dict(Counter(r.pd or "none" for r in streams)),
    }
    if transfer is not None:
        pulls = transfer.get("pulls", 0.0)
        row["pulls"] = pulls
        row["pull_s"] = transfer["pull_seconds"] / pulls if pulls else None
        row["pull_mb"] = transfer["bytes"] / pulls / 1e6 if pulls else None
        row["pull_share"] = (row["pull_s"] / row["long_ttft_s"]
                             if row["pull_s"] is not None and row["long_ttft_s"] else None)
        row["fallbacks"] = transfer.get("fallbacks", 0.0)
        row["leg_failures"] = transfer.get("leg_failures", 0.0)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's `p99_vs_baseline`: its ITL p99 over that of its shape's baseline phase
    (the row whose long_sent is 0 and shape is the same); None without one."""
    base = {r["shape"]: r["itl_p99_ms"] for r in rows if r["long_sent"] == 0}
    for r in rows:
        b = base.get(r["shape"])
        r["p99_vs_baseline"] = r["itl_p99_ms"] / b if b else None


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{unit}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The docs' markdown table, one line per phase."""
    header = ("| phase | long prompts (done) | streams' ITL p50 | ITL p99 | p99 / baseline "
              "| ITL p99.9 | longest gap | stalls ≥ 1 s | stream tok/s | long TTFT mean (p99) "
              "| pull per prompt | pull share of TTFT | fallbacks |")
    lines = [header, "|" + "---|" * 13]
    for r in rows:
        pull = (f"{r['pull_s']:.2f} s, {r['pull_mb']:.1f} MB" if r.get("pull_s") is not None
                else "–")
        ttft = (f"{r['long_ttft_s']:.1f} s ({r['long_ttft_p99_s']:.1f} s)"
                if r["long_ttft_s"] is not None else "–")
        lines.append(
            f"| {r['phase']} | {r['long_sent']} ({r['long_done']}) "
            f"| {_fmt(r['itl_p50_ms'], ',.0f', ' ms')} | {_fmt(r['itl_p99_ms'], ',.0f', ' ms')} "
            f"| {_fmt(r.get('p99_vs_baseline'), '.2f')} | {_fmt(r['itl_p999_ms'], ',.0f', ' ms')} "
            f"| {_fmt(r['itl_max_ms'], ',.0f', ' ms')} | {r['stalls']} "
            f"| {r['stream_tok_s']:.1f} | {ttft} "
            f"| {pull} | {_fmt(r.get('pull_share'), '.1%')} "
            f"| {_fmt(r.get('fallbacks'), '.0f')} |")
    return "\n".join(lines)
