"""The soak's PNG (matplotlib, Agg): latency, requests and failures, and each process's RSS
over the run, with the faults marked (helper of `sluice bench soak`)."""

from __future__ import annotations

from typing import Any


def plot_soak(path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["over_time"]
    t = [r["t"] / 60 for r in rows]
    nan = float("nan")
    fig, (lat, req, mem) = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    for key, style in (("ttft_ms_p50", "-"), ("ttft_ms_p90", ":"), ("e2e_ms_p50", "-"),
                       ("e2e_ms_p90", ":")):
        values = [nan if r[key] is None else r[key] for r in rows]
        lat.plot(t, values, style, label=key.replace("_ms_", " "))
    lat.set(ylabel="ms", title="Latency of the requests sent in each interval")
    lat.set_yscale("log")
    lat.legend(loc="upper left", fontsize=8)

    req.plot(t, [r["ok"] for r in rows], "k-", label="ok")
    causes = sorted({c for r in rows for c in r["errors"]})
    width = (t[1] - t[0]) * 0.9 if len(t) > 1 else 0.1
    bottom = [0] * len(rows)
    for cause in causes:
        counts = [r["errors"].get(cause, 0) for r in rows]
        req.bar(t, counts, width, bottom=bottom, align="edge", label=cause)
        bottom = [b + c for b, c in zip(bottom, counts)]
    req.set(ylabel="requests", title="Requests sent per interval: answered, and failed by cause")
    req.legend(loc="upper left", fontsize=8)

    for name, samples in report["rss_samples"].items():
        mem.plot([s[0] / 60 for s in samples], [s[2] for s in samples], ".", markersize=2,
                 label=name)
    mem.set(ylabel="MiB", xlabel="minutes", title="RSS of each process (with its children)")
    mem.set_yscale("log")
    mem.legend(loc="upper left", fontsize=8)

    for e in report["events"]:
        for ax in (lat, req, mem):
            ax.axvline(e["t"] / 60, color="red", linewidth=0.8)
            if e.get("serving_t") is not None:
                ax.axvline(e["serving_t"] / 60, color="green", linewidth=0.8)
        lat.annotate(f"{e['target']} killed", (e["t"] / 60, 1), fontsize=8, color="red",
                     xycoords=("data", "axes fraction"), va="top")
    fig.suptitle(report["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
