"""The report of `sluice bench engine --compare vllm --mode serving`: per thread setup,
each engine's binding, then per run both engines' figures and their ratio."""

from __future__ import annotations

# (label, summary -> value): what the report shows of each run, and takes ratios of
FIGURES = (("out tok/s", lambda s: s["output_throughput"]),
           ("TTFT p50", lambda s: s["ttft_ms"]["p50"]),
           ("TTFT p90", lambda s: s["ttft_ms"]["p90"]),
           ("TPOT p50", lambda s: s["tpot_ms"]["p50"]),
           ("ITL p50", lambda s: s["itl_ms"]["p50"]))


def ratios(vllm: dict, sluice: dict) -> dict[str, float]:
    """Sluice / vLLM for every reported figure (NaN where vLLM's is 0)."""
    out = {}
    for label, fn in FIGURES:
        v = fn(vllm)
        out[label] = fn(sluice) / v if v else float("nan")
    return out


def format_report(levels: list[dict]) -> str:
    head = f"{'run':<20}" + "".join(f"{label:>11}" for label, _ in FIGURES) + f"{'ok/fail':>9}"
    lines = [head, "-" * len(head)]
    for level in levels:
        tag = f"c={level['concurrency']} n={level['requests']}"
        for name in ("vllm", "sluice"):
            s = level[name]
            lines.append(f"{name + ' ' + tag:<20}" + "".join(f"{fn(s):>11.1f}" for _, fn in
                                                            FIGURES)
                         + f"{s['completed']:>5}/{s['failed']}")
        lines.append(f"{'sluice/vllm':<20}" + "".join(f"{level['ratio'][label]:>10.2f}x"
                                                      for label, _ in FIGURES))
    return "\n".join(lines + ["(latencies in ms; ratio: sluice / vllm)"])


def format_setup(name: str, binding: dict[str, str], levels: list[dict]) -> str:
    return "\n".join([f"== threads: {name}", f"   sluice: {binding['sluice']}",
                      f"   vllm:   {binding['vllm']}", format_report(levels)])
