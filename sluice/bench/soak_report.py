"""What a soak run says (helper of `sluice bench soak`): failures by cause, each either
explained by the engine kill or lost, latency over time, and whether each process's memory
stayed flat.

The target, from issue 21: no request lost except those in flight on the killed engine,
each of which ends with an error, never a hang; and every process's RSS flat within 5 %
after warm-up. A failure is explained when its request was answered by the engine that was
killed and was still open at the kill (1 s of slack for the error to arrive); a timeout is
never explained. Memory is judged per process incarnation (a restarted engine or Redis is
a new process): after `warmup_s` of its serving life (a restarted one's from when it served
again: an engine loads its model first), the median of its last tenth of samples against
the median of its first tenth.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from sluice.bench.soak_load import Outcome

SLACK_S = 1.0
FLAT = 0.05


def explained_by(o: Outcome, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The engine kill that explains `o`'s failure, if one does."""
    if o.ok or o.cause == "timeout" or o.pod is None:
        return None
    for e in events:
        if e.get("pod") == o.pod and o.start <= e["t"] <= o.end + SLACK_S:
            return e
    return None


def request_summary(outcomes: list[Outcome], events: list[dict[str, Any]],
                    shed: int) -> dict[str, Any]:
    failed = [o for o in outcomes if not o.ok]
    lost = [o for o in failed if explained_by(o, events) is None]
    killed = [e for e in events if e.get("pod")]
    in_flight = [o for o in outcomes for e in killed
                 if o.pod == e["pod"] and o.start <= e["t"] <= o.end]
    return {
        "requests": len(outcomes), "ok": len(outcomes) - len(failed), "failed": len(failed),
        "errors_by_cause": dict(Counter(o.cause for o in failed)),
        "in_flight_on_killed_engine": len(in_flight),
        "in_flight_on_killed_engine_failed": sum(not o.ok for o in in_flight),
        "lost": len(lost), "lost_by_cause": dict(Counter(o.cause for o in lost)),
        "hangs": sum(o.cause == "timeout" for o in outcomes),
        "not_sent_at_max_in_flight": shed,
        "output_tokens": sum(o.output_tokens for o in outcomes if o.ok),
    }


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def latency_over_time(outcomes: list[Outcome], duration_s: float,
                      width_s: float) -> list[dict[str, Any]]:
    """One row per `width_s` of send time: counts, failures by cause, TTFT and E2E (ms)."""
    rows = []
    for i in range(max(1, int(np.ceil(duration_s / width_s)))):
        lo, hi = i * width_s, (i + 1) * width_s
        sent = [o for o in outcomes if lo <= o.start < hi]
        ok = [o for o in sent if o.ok]
        ttft = [o.ttft for o in ok if o.ttft is not None]
        e2e = [o.e2e for o in ok]
        rows.append({"t": round(lo, 1), "sent": len(sent), "ok": len(ok),
                     "errors": dict(Counter(o.cause for o in sent if not o.ok)),
                     "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p90": _pct(ttft, 90),
                     "e2e_ms_p50": _pct(e2e, 50), "e2e_ms_p90": _pct(e2e, 90)})
    return rows


def rss_verdicts(samples: dict[str, list[tuple[float, int, float]]], warmup_s: float,
                 events: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Per process incarnation (name, pid): RSS after warm-up, growth, flat or not (None
    when it lived too short a time after its warm-up to say). `events`: the faults, whose
    `serving_t` starts the serving life of the process restarted after each."""
    out = []
    for name, rows in samples.items():
        for pid in dict.fromkeys(p for _, p, _ in rows):
            mine = [(t, mib) for t, p, mib in rows if p == pid]
            start = mine[0][0]
            for e in events:
                if e["target"] == name and e["t"] <= start and e.get("serving_t"):
                    start = max(start, e["serving_t"])
            after = [mib for t, mib in mine if t >= start + warmup_s]
            verdict: dict[str, Any] = {"process": name, "pid": pid, "from_s": start,
                                       "to_s": mine[-1][0], "samples_after_warmup": len(after)}
            if len(after) >= 6:
                k = max(3, len(after) // 10)
                base, final = float(np.median(after[:k])), float(np.median(after[-k:]))
                verdict.update(rss_mib_after_warmup=round(base, 1),
                               rss_mib_end=round(final, 1),
                               growth=round(final / base - 1, 4),
                               peak_growth=round(max(after) / base - 1, 4))
                verdict["flat"] = abs(final / base - 1) <= FLAT
            else:
                verdict["flat"] = None
            out.append(verdict)
    return out


def targets(requests: dict[str, Any], rss: list[dict[str, Any]]) -> dict[str, Any]:
    judged = [v["flat"] for v in rss if v["flat"] is not None]
    return {"no_request_lost": requests["lost"] == 0,
            "no_hang": requests["hangs"] == 0,
            "rss_flat_within_5pct": all(judged) if judged else None}


def format_summary(report: dict[str, Any]) -> str:
    r, t = report["requests"], report["targets"]
    lines = [
        (f"requests {r['requests']}: ok {r['ok']}, failed {r['failed']} "
         f"{r['errors_by_cause'] or ''}"),
        (f"in flight on the killed engine: {r['in_flight_on_killed_engine']} "
         f"({r['in_flight_on_killed_engine_failed']} of them failed)"),
        (f"lost: {r['lost']} {r['lost_by_cause'] or ''}, hangs: {r['hangs']}, "
         f"not sent (max in flight): {r['not_sent_at_max_in_flight']}"),
    ]
    for e in report["events"]:
        back = e.get("serving_t")
        lines.append(f"{e['target']} killed at {e['t']:.0f} s, running again at "
                     f"{e.get('restarted_t') or float('nan'):.1f} s, serving at "
                     f"{back if back is not None else float('nan'):.1f} s")
    lines.append("RSS after warm-up -> end (MiB):")
    for v in report["rss"]:
        if v["flat"] is None:
            lines.append(f"  {v['process']:<9} pid {v['pid']}: too short after warm-up")
        else:
            lines.append(f"  {v['process']:<9} pid {v['pid']}: {v['rss_mib_after_warmup']} -> "
                         f"{v['rss_mib_end']} ({100 * v['growth']:+.1f} %, peak "
                         f"{100 * v['peak_growth']:+.1f} %)")
    lines.append("targets: " + ", ".join(f"{k} {'yes' if v else 'n/a' if v is None else 'NO'}"
                                         for k, v in t.items()))
    return "\n".join(lines)
