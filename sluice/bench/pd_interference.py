"""Disaggregated prefill/decode, engine side, without a picker: does a long prompt still
stall the decode streams when another engine prefills it?

Two `sluice engine` processes, P (kv_producer) and D (kv_consumer). S decode-heavy
streams run on D in three phases of equal length:
  baseline       no long prompts;
  aggregated     long prompts (Poisson arrivals) sent to D, which prefills them;
  disaggregated  the same prompts sent to D with `x-prefiller-host-port: P` (llm-d's
                 contract): P prefills, D pulls the blocks and decodes.
Reports the streams' inter-token latency (p50 / p99) per phase, the long prompts' TTFT,
and for the disaggregated phase the pull's share of that TTFT (D's
sluice:kv_transfer_time_seconds) and the bytes moved.

    python -m sluice.bench.pd_interference --model default --prompt-len 2000

`--through-stack`: the same workload through the whole local stack (Envoy, the picker,
Redis, engines), aggregated against disaggregated with the picker choosing roles
(`pd_stack.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time

import httpx

from sluice.bench import pd_stack
from sluice.local.stack import free_ports


def _engine(args, port: int, role: str) -> subprocess.Popen:
    cfg = {"kv_connector": "SluiceConnector", "kv_role": role, "kv_port": 0}
    cmd = [sys.executable, "-m", "sluice.cli", "engine", "--model", args.model, "--port",
           str(port), "--num-threads", str(args.num_threads), "--log-level", "warning",
           "--kv-transfer-config", json.dumps(cfg), *args.engine_args]
    return subprocess.Popen(cmd, start_new_session=True)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"engine at {url} exited"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def _metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith((name + "{", name + " ")) and label in ln)


def _stream(url: str, prompt: str, max_tokens: int, gaps: list[float] | None,
            headers: dict | None = None) -> float:
    """Stream one completion; append inter-token gaps to `gaps`; return its TTFT."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    last = first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            elif gaps is not None:
                gaps.append(now - last)
            last = now
    assert first is not None, "no tokens"
    return first


def _long_prompt(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(100000)}" for _ in range(words))


def _phase(args, d_url: str, mode: str, p_hostport: str, rng: random.Random) -> dict:
    gaps: list[float] = []
    ttfts: list[float] = []
    streams = [threading.Thread(target=_stream, args=(
        d_url, f"Stream {i} of the {mode} phase: tell a long story.", args.stream_tokens, gaps))
        for i in range(args.streams)]
    for t in streams:
        t.start()
    longs: list[threading.Thread] = []
    time.sleep(args.warmup_s)
    end = time.monotonic() + args.phase_s
    while mode != "baseline" and time.monotonic() < end:
        prompt = _long_prompt(rng, args.words)
        headers = {"x-prefiller-host-port": p_hostport} if mode == "disaggregated" else None
        t = threading.Thread(target=lambda p=prompt, h=headers: ttfts.append(
            _stream(d_url, p, 8, None, h)))
        t.start()
        longs.append(t)
        time.sleep(rng.expovariate(args.rate))
    for t in streams + longs:
        t.join()
    gaps.sort()
    return {"phase": mode, "itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))], "num_gaps": len(gaps),
            "long_prompts": len(ttfts),
            "long_ttft_s": statistics.mean(ttfts) if ttfts else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.pd_interference")
    p.add_argument("--model", default="default")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=2000, help="long prompts, ~tokens")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--rate", type=float, default=0.1, help="long prompts per second")
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("engine_args", nargs="*", help="extra `sluice engine` flags (after --)")
    pd_stack.add_arguments(p)
    args = p.parse_args(argv)
    if args.through_stack:
        return pd_stack.main(args)
    p_port, d_port = free_ports(2)
    procs = [_engine(args, p_port, "kv_producer"), _engine(args, d_port, "kv_consumer")]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    try:
        for url, proc in zip((p_url, d_url), procs):
            _wait(url, proc)
        rng = random.Random(args.seed)
        # calibrate words per prompt on the engine's tokenizer ("w12345" is several tokens)
        sample = _long_prompt(random.Random(-1), 200)
        tokens = httpx.post(d_url + "/tokenize", json={"prompt": sample}, timeout=30).json()
        args.words = max(1, round(args.prompt_len * 200 / tokens["count"]))
        sample = _long_prompt(random.Random(-1), args.words)
        n = httpx.post(d_url + "/tokenize", json={"prompt": sample}, timeout=30).json()["count"]
        print(json.dumps({"long_prompt_tokens": n}), flush=True)
        rows = []
        for mode in ("baseline", "aggregated", "disaggregated"):
            secs = _metric(d_url, "sluice:kv_transfer_time_seconds_sum", "received")
            count = _metric(d_url, "sluice:kv_transfer_time_seconds_count", "received")
            moved = _metric(d_url, "sluice:kv_transfer_bytes_total", "received")
            row = _phase(args, d_url, mode, f"127.0.0.1:{p_port}", rng)
            pulls = _metric(d_url, "sluice:kv_transfer_time_seconds_count", "received") - count
            if pulls:
                row["pull_s"] = (_metric(d_url, "sluice:kv_transfer_time_seconds_sum",
                                         "received") - secs) / pulls
                row["pull_mb"] = (_metric(d_url, "sluice:kv_transfer_bytes_total", "received")
                                  - moved) / pulls / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
        base = rows[0]["itl_p99_ms"]
        for row in rows[1:]:
            print(f"{row['phase']}: ITL p99 {row['itl_p99_ms'] / base:.2f}x baseline")
        fallbacks = _metric(d_url, "sluice:kv_transfer_fallbacks_total")
        failures = _metric(d_url, "sluice:kv_transfer_prefill_leg_failures_total")
        print(json.dumps({"fallbacks": fallbacks, "prefill_leg_failures": failures}))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
