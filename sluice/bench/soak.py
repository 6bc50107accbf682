"""`sluice bench soak`: steady mixed load through the whole local stack for a long time, with
faults, watching for lost requests, hangs and memory that grows.

The stack is `sluice up`'s (`sluice.local`): Redis, N engines (2 by default), the endpoint
picker and Envoy, kept running by `sluice up`'s supervisor. For `--duration` minutes (30
by default) Poisson arrivals of a mixed workload (`soak_load.py`) go through the gateway;
at a third of the run the busiest engine is killed (SIGKILL, as a crash) and at two thirds
Redis, and the supervisor restarts each. Meanwhile the RSS of every process (with its children)
is sampled (`soak_procs.py`).

Results, in `--out` (default bench_results/soak-DATE): `soak.json` (every figure, each
request's outcome, the RSS samples), `soak.png` (latency, failures by cause and RSS over
time, faults marked) and `stack.log` (the processes' own logs). The summary printed says
whether the targets were met (`soak_report.py`); the exit status is 1 when a request was
lost or hung.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from sluice.bench import soak_report
from sluice.bench.soak_load import drive
from sluice.bench.soak_procs import RssSampler, kill, wait_restarted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=30.0, help="minutes of load")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--model", default="default", help="every engine's model")
    p.add_argument("--engine-args", default="", help="extra engine flags")
    p.add_argument("--routing", default="kv_aware")
    p.add_argument("--port", type=int, default=0, help="the gateway's port (0: a free one)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds after which a request still open counts as a hang")
    p.add_argument("--warmup", type=float, default=None,
                   help="minutes of each process's life before its RSS is judged "
                        "(default: a tenth of --duration)")
    p.add_argument("--sample-every", type=float, default=None,
                   help="seconds between RSS samples (default: 300 samples a run, 1-10 s)")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds per latency row (default: 60 rows a run, at least 10 s)")
    p.add_argument("--no-faults", action="store_true", help="no kills: a baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder")


class Faults(threading.Thread):
    """Kills an engine at a third of the run and Redis at two thirds, then waits until each
    is running and serving again. The engine is the one answering the most streams then
    (`open_streams`, kept by the load), waiting up to 30 s for one to answer any: a kill
    must cut streams for the soak to show what becomes of them. Owns `events` until
    joined."""

    def __init__(self, stack: Any, t0: float, duration_s: float, say: Any,
                 open_streams: Counter) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.stack, self.t0, self.duration_s, self.say = stack, t0, duration_s, say
        self.open_streams = open_streams
        self.events: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def run(self) -> None:
        if self._until(1 / 3):
            return
        i = self._busiest_engine()
        victim = self.stack.engine_urls[i]
        pod = victim.removeprefix("http://")
        self._fault(self.stack.engines[i], {"pod": pod}, lambda: self._gateway().get(
            "pods", {}).get(pod) is True and _status(victim + "/health") == 200)
        if self.stack.redis is not None and not self._until(2 / 3):
            self._fault(self.stack.redis, {}, lambda: self._gateway().get("index") == "redis")

    def _until(self, share: float) -> bool:
        """Wait for `share` of the run; True when stopped first."""
        return self.stop.wait(max(0.0, self.t0 + share * self.duration_s - time.monotonic()))

    def _busiest_engine(self) -> int:
        pods = [url.removeprefix("http://") for url in self.stack.engine_urls]
        deadline = time.monotonic() + 30
        while True:
            streams = [self.open_streams[pod] for pod in pods]
            if max(streams) > 0 or time.monotonic() > deadline or self.stop.is_set():
                return streams.index(max(streams))
            time.sleep(0.01)

    def _fault(self, child: Any, extra: dict[str, Any], serving: Any) -> None:
        event = {"target": child.name, "t": self.now(), **extra}
        self.events.append(event)
        event["pid"] = kill(child)
        self.say(f"killed {child.name} (pid {event['pid']}) at {event['t']:.0f} s")
        if wait_restarted(child, event["pid"], 120):
            event["restarted_t"] = self.now()
            deadline = time.monotonic() + 120
            while not self.stop.is_set() and time.monotonic() < deadline:
                if serving():
                    event["serving_t"] = self.now()
                    break
                time.sleep(0.25)
        self.say(f"{child.name}: running again at {event.get('restarted_t')} s, serving at "
                 f"{event.get('serving_t')} s")

    def _gateway(self) -> dict[str, Any]:
        try:
            return httpx.get(self.stack.url + "/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return {}


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


class Supervising(threading.Thread):
    """`sluice up`'s main loop in a thread: restarts whatever child exits."""

    def __init__(self, children: list[Any], out: Any) -> None:
        from sluice.local.supervisor import Supervisor

        super().__init__(name="soak-supervisor", daemon=True)
        self.children, self.supervisor = children, Supervisor(out)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.supervisor.check(self.children)


def main(args: argparse.Namespace) -> int:
    from sluice.local.stack import LocalStack, StackConfig, free_port

    duration_s = args.duration * 60
    warmup_s = (args.warmup * 60) if args.warmup is not None else duration_s / 10
    every_s = args.sample_every or min(10.0, max(1.0, duration_s / 300))
    width_s = args.interval or max(10.0, duration_s / 60)
    out = Path(args.out or f"bench_results/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        print(f"soak: {line}", file=sys.stderr, flush=True)

    log = open(out / "stack.log", "w", buffering=1)  # noqa: SIM115 -- closed below
    stack = LocalStack(StackConfig(engines=args.engines, model=args.model,
                                   routing=args.routing, port=args.port or free_port(),
                                   engine_args=tuple(shlex.split(args.engine_args)),
                                   log_level="warning"), out=log)
    supervising = faults = sampler = None
    try:
        say(f"starting the stack ({args.engines} engines, {args.model}); logs: "
            f"{out / 'stack.log'}")
        stack.start()
        supervising = Supervising(stack.children(), log)
        supervising.start()
        model = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        t0 = time.monotonic()
        sampler = RssSampler(stack.children(), every_s, t0)
        sampler.start()
        open_streams: Counter = Counter()
        faults = Faults(stack, t0, duration_s, say, open_streams)
        if not args.no_faults:
            faults.start()
        say(f"{args.duration:g} min of load at {args.rate:g} req/s through {stack.url}")
        outcomes, shed = asyncio.run(drive(stack.url, model, duration_s, args.rate, args.seed,
                                           args.request_timeout, t0,
                                           open_streams=open_streams))
        if faults.is_alive():
            faults.join(60)  # (a restart late in a short run: see it serve again)
    finally:
        for thread in (faults, supervising):
            if thread is not None and thread.is_alive():
                thread.stop.set()
                thread.join(130)
        if sampler is not None:
            sampler.stop()
        restarts = ({c.name: supervising.supervisor.restarts(c.name)
                     for c in stack.children()} if supervising is not None else {})
        stack.stop()
        log.close()

    requests = soak_report.request_summary(outcomes, faults.events, shed)
    rss = soak_report.rss_verdicts(sampler.samples, warmup_s, faults.events)
    report = {
        "title": f"sluice bench soak: {args.duration:g} min at {args.rate:g} req/s, "
                 f"{args.engines} engines ({args.model}), {time.strftime('%Y-%m-%d')}",
        "meta": {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                 "machine": platform.platform(),
                 "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "warmup_s": warmup_s, "sample_every_s": every_s, "interval_s": width_s},
        "requests": requests, "events": faults.events, "restarts": restarts,
        "over_time": soak_report.latency_over_time(outcomes, duration_s, width_s),
        "rss": rss, "targets": soak_report.targets(requests, rss),
        "rss_samples": sampler.samples,
        "outcomes": [o.row() for o in outcomes],
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    from sluice.bench.soak_plot import plot_soak

    plot_soak(str(out / "soak.png"), report)
    print(soak_report.format_summary(report))
    print(f"results: {out / 'soak.json'}, {out / 'soak.png'}")
    met = report["targets"]
    return 0 if met["no_request_lost"] and met["no_hang"] else 1
