"""PNG plots of serving runs (matplotlib, Agg backend)."""

from __future__ import annotations

from typing import Any

from sluice.bench.serve_client import Result


def plot_runs(path: str, runs: dict[str, tuple[dict[str, Any], list[Result]]],
              title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(runs)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for name in names:
        ttfts = sorted(r.ttft * 1000 for r in runs[name][1] if r.ok and r.ttft is not None)
        if ttfts:
            axes[0].plot(ttfts, np.linspace(0, 1, len(ttfts)), label=name)
    axes[0].set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    axes[0].set_xscale("log")
    axes[0].legend()
    x = np.arange(len(names))
    for i, p in enumerate(("p50", "p90")):
        axes[1].bar(x + (i - 0.5) * 0.4, [runs[n][0]["ttft_ms"][p] for n in names], 0.4,
                    label=f"TTFT {p}")
    axes[1].set(xticks=x, xticklabels=names, ylabel="ms", title="TTFT")
    axes[1].legend()
    axes[2].bar(x, [runs[n][0]["output_throughput"] for n in names])
    axes[2].set(xticks=x, xticklabels=names, ylabel="tokens/s", title="Output throughput")
    axes[3].bar(x, [100 * (runs[n][0].get("hit_rate") or 0) for n in names])
    ideal = [runs[n][0].get("ideal_hit_rate") for n in names]
    if any(v is not None for v in ideal):
        axes[3].plot(x, [100 * (v or 0) for v in ideal], "k_", markersize=30, label="ideal")
        axes[3].legend()
    axes[3].set(xticks=x, xticklabels=names, ylabel="%", title="Prefix-cache hit rate")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
