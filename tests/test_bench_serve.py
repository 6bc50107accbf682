"""`sluice bench serve`: workloads, stats, and a --compare run on a tiny local stack."""

import argparse
import json
import random

import pytest

from sluice.bench import serve
from sluice.bench.serve_client import Result
from sluice.bench.serve_stats import summarize
from sluice.bench.serve_workloads import (
    TextMaker,
    ideal_hit_tokens,
    multi_turn_workload,
    shared_prefix_workload,
)


def test_shared_prefix_workload_shape_and_ideal(tiny_chat_model):
    from sluice.tokenizer import Tokenizer

    reqs = shared_prefix_workload(3, 4, 64, 8, 5, TextMaker(random.Random(0)))
    assert len(reqs) == 12 and sorted(r.group for r in reqs) == sorted([0, 1, 2] * 4)
    systems = {r.group: r.messages[0]["content"] for r in reqs}
    assert all(r.messages[0]["content"] == systems[r.group] for r in reqs)
    assert len({r.messages[1]["content"] for r in reqs}) == 12
    again = shared_prefix_workload(3, 4, 64, 8, 5, TextMaker(random.Random(0)))
    assert [r.messages for r in again] == [r.messages for r in reqs]  # seed-fixed
    hit, total = ideal_hit_tokens(reqs, Tokenizer.from_path(str(tiny_chat_model)), 16)
    assert 0.5 < hit / total < 0.8  # 9 of 12 prompts reuse ~64 of ~90 tokens
    mt = multi_turn_workload(2, 3, 16, 8, 4, TextMaker(random.Random(0)))
    assert len(mt) == 2 and all(len(r.questions) == 3 for r in mt)


def test_summarize_percentiles():
    rs = [Result(ok=True, start=0, e2e=1.0 + i, ttft=0.1 * (i + 1), itl=[0.01] * 3,
                 prompt_tokens=10, output_tokens=4) for i in range(10)]
    rs.append(Result(ok=False, start=0, error="HTTP 503"))
    s = summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (10, 1, ["HTTP 503"])
    assert abs(s["ttft_ms"]["p50"] - 550) < 1e-6 and s["output_throughput"] == 20
    assert abs(s["itl_ms"]["mean"] - 10) < 1e-9


@pytest.mark.slow  # a local stack, run twice
def test_compare_on_local_stack(tiny_chat_model, tmp_path):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([
        "--compare", "round_robin,kv_aware", "--engines", "2", "--stack-model",
        str(tiny_chat_model), "--engine-args", "--num-kv-blocks 512 --max-model-len 1024",
        "--groups", "4", "--users", "4", "--system-len", "160", "--question-len", "12",
        "--output-len", "4", "--max-concurrency", "2", "--tokenizer", str(tiny_chat_model),
        "--result-json", str(tmp_path / "r.json"), "--save-detailed",
        "--plot", str(tmp_path / "r.png"),
        "--stack-port", str(__import__("engine_server").free_port()), "--no-progress"])
    assert serve.main(args) == 0
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert set(runs) == {"round_robin", "kv_aware"}
    rr, kv = runs["round_robin"], runs["kv_aware"]
    assert rr["completed"] == kv["completed"] == 16
    ideal = kv["ideal_hit_rate"]
    assert kv["hit_rate"] >= 0.9 * ideal and kv["hit_rate"] > rr["hit_rate"]
    assert (tmp_path / "r.png").stat().st_size > 10_000
    for run in (rr, kv):  # --save-detailed: every request, in send order
        reqs = run["requests"]
        assert len(reqs) == 16 and all(r["ok"] and r["ttft_ms"] <= r["e2e_ms"] for r in reqs)
        assert reqs[0]["start_s"] == 0 and [r["start_s"] for r in reqs] == sorted(
            r["start_s"] for r in reqs)
        assert {r["pod"] for r in reqs} == set(run["requests_per_pod"])


@pytest.mark.slow  # Envoy, picker and Redis processes, 4 x 60 requests
def test_overhead_benchmark_runs_end_to_end():
    """`python -m sluice.bench.serve_overhead` at a small scale: real processes, every
    request answered along every path, and the report's figures consistent."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "sluice.bench.serve_overhead", "--rate", "40",
                          "--requests", "60"], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    paths = ("envoy", "envoy_stub", "envoy_picker_rr", "envoy_picker")
    assert all(report[f"{p}_failed"] == 0 for p in ("direct", *paths))
    for p in paths:
        for q in (50, 90, 99):
            assert report[f"{p}_overhead_ms_p{q}"] == report[f"{p}_ms_p{q}"] - report[
                f"direct_ms_p{q}"]
            assert report[f"{p}_ms_p{q}"] > 0
        # one p50 difference per round: each path took a turn in each of the 4 rounds
        assert len(report[f"{p}_overhead_ms_p50_by_round"]) == report["rounds"] == 4
    # routing time of the measured requests from the picker's own histogram: tokenizing
    # and the index make kv_aware slower than round robin
    kv, rr = report["envoy_picker_gateway_routing_ms_mean"], \
        report["envoy_picker_rr_gateway_routing_ms_mean"]
    assert 0 < rr < kv < report["envoy_picker_ms_p99"]
    # tokenization is its first part, and round robin never tokenizes
    assert 0 < report["envoy_picker_gateway_tokenize_ms_mean"] < kv
    assert report["envoy_picker_rr_gateway_tokenize_ms_mean"] == 0
    # the picker process's CPU over the measured requests (Linux /proc), per request; the
    # do-nothing picker's too, and it has no routing histogram
    for p in ("envoy_stub", "envoy_picker"):
        assert 0 < report[f"{p}_cpu_ms_per_request"] < 1000
    assert "envoy_stub_gateway_routing_ms_mean" not in report


def test_a_failed_turn_fails_the_rest_of_its_session():
    """Every turn of the workload is accounted for: a session whose turn fails
    cannot go on, and its later turns count as failed."""
    import asyncio

    from engine_server import free_port
    from fake_engine import ThreadServer as Server
    from fake_engine import fake_engine

    from sluice.bench.serve_client import run

    requests = multi_turn_workload(3, 4, 20, 8, 2, TextMaker(random.Random(0)))
    with Server(fake_engine("error500", {})) as up:
        results, _ = asyncio.run(run(requests, up.url, "m", float("inf"), 2, 0))
    assert len(results) == 12 and not any(r.ok for r in results)
    dead = f"http://127.0.0.1:{free_port()}"
    results, _ = asyncio.run(run(requests, dead, "m", float("inf"), 2, 0))
    assert len(results) == 12


def test_token_events_are_chunks_with_choices_even_with_empty_text():
    """As vLLM's bench: a special token (empty text) is a token; E2E ends at the
    last token chunk, not at the usage chunk after it."""
    import asyncio
    import json
    import time

    import httpx
    from fake_engine import ThreadServer as Server
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from sluice.bench.serve_client import send
    from sluice.bench.serve_workloads import Request

    app = FastAPI()

    @app.post("/v1/completions")
    async def complete():
        async def gen():
            for text in ("", "a"):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def go(url):
        async with httpx.AsyncClient(timeout=10) as client:
            return await send(client, url, "m", Request("completion", 2, prompt="hi"))

    with Server(app) as up:
        t = time.perf_counter()
        res = asyncio.run(go(up.url))
        total = time.perf_counter() - t
    assert res.ok and res.text == "a" and res.output_tokens == 2 and len(res.itl) == 1
    assert res.ttft < res.e2e < total - 0.3


def test_an_engine_that_does_not_answer_leaves_the_hit_rate_unknown():
    from engine_server import free_port

    from sluice.bench.serve_stats import scrape_prefix_counters

    assert scrape_prefix_counters([f"http://127.0.0.1:{free_port()}"]) is None


def test_a_taken_gateway_port_fails_the_stack_before_it_starts_anything():
    import socket

    import pytest

    from sluice.local.stack import LocalStack, StackConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        stack = LocalStack(StackConfig(port=s.getsockname()[1]))
        with pytest.raises(RuntimeError, match="already in use"):
            stack.start()
        assert stack.children() == []


def test_a_second_ctrl_c_while_stopping_does_not_cut_the_stop_short():
    import os

    from sluice.local.stack import LocalStack, StackConfig

    stack = LocalStack(StackConfig())
    calls = {"engines": 0, "redis": 0}

    def stop_engines():
        calls["engines"] += 1
        if calls["engines"] == 1:
            raise KeyboardInterrupt  # the user presses Ctrl-C again

    class Redis:
        def stop(self):
            calls["redis"] += 1

    stack.stop_engines = stop_engines
    stack.redis = Redis()
    stack.stop()
    assert calls == {"engines": 2, "redis": 1} and stack.redis is None
    assert not os.path.exists(stack.dir)
