"""`sluice bench soak`: how each request's end is classified (against a real HTTP server that
misbehaves in each way), what the report explains and what it counts as lost, the RSS
verdicts, the plot; and a short soak of the whole local stack with its two faults."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web
from engine_server import free_port

from sluice.bench import soak, soak_report
from sluice.bench.soak_load import Outcome, send
from sluice.bench.soak_plot import plot_soak

CHUNK = 'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'


async def misbehaving_server(release: asyncio.Event) -> tuple[web.AppRunner, str]:
    async def stream(request: web.Request) -> web.StreamResponse:
        how = request.match_info["how"]
        if how == "503":
            return web.Response(status=503, text="no healthy upstream")
        if how == "hang":
            await release.wait()  # (until the test is done with the server)
        if how == "json":
            return web.json_response({"choices": [{"text": "x"}], "usage": {
                "completion_tokens": 3}})
        if how == "empty":
            return web.json_response({"choices": []})
        resp = web.StreamResponse(headers={"x-sluice-pod": "127.0.0.1:1"})
        await resp.prepare(request)
        await resp.write(CHUNK.encode())
        if how == "done":
            await resp.write(b"data: [DONE]\n\n")
        elif how == "error":
            await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
        elif how == "cut":
            request.transport.close()  # the connection breaks mid-answer
            return resp
        await resp.write_eof()  # "truncated": a clean end without [DONE]
        return resp

    app = web.Application()
    app.router.add_post("/{how}", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_each_way_a_request_can_end_has_its_cause():
    async def main():
        release = asyncio.Event()
        runner, url = await misbehaving_server(release)
        got = {}
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                t0 = time.monotonic()
                for how, stream in (("done", True), ("error", True), ("truncated", True),
                                    ("cut", True), ("503", True), ("hang", True),
                                    ("json", False), ("empty", False)):
                    o = await send(client, f"{url}/{how}", {"stream": stream}, t0, 1.0)
                    got[how] = (o.ok, o.cause, o.pod)
                refused = f"http://127.0.0.1:{free_port()}/done"
                o = await send(client, refused, {"stream": True}, t0, 1.0)
                got["refused"] = (o.ok, o.cause, o.pod)
        finally:
            release.set()
            await runner.cleanup()
        return got

    pod = "127.0.0.1:1"
    assert asyncio.run(main()) == {
        "done": (True, "ok", pod), "error": (False, "stream_error", pod),
        "truncated": (False, "stream_truncated", pod), "cut": (False, "stream_cut", pod),
        "503": (False, "http_503", None), "hang": (False, "timeout", None),
        "json": (True, "ok", None), "empty": (False, "bad_body", None),
        "refused": (False, "connection", None)}


def test_only_failures_open_on_the_killed_engine_at_the_kill_are_explained():
    kill = {"target": "engine-0", "t": 10.0, "pod": "a:1"}
    redis = {"target": "redis", "t": 20.0}
    outcomes = [
        Outcome(start=9.0, end=10.2, cause="stream_cut", pod="a:1"),  # open at the kill
        Outcome(start=8.0, end=9.5, ok=True, pod="a:1"),  # done before it
        Outcome(start=9.5, end=10.3, cause="stream_cut", pod="b:2"),  # the other engine: lost
        Outcome(start=9.9, end=130.0, cause="timeout", pod="a:1"),  # a hang: never explained
        Outcome(start=19.0, end=20.5, cause="http_503"),  # during the Redis outage: lost
        Outcome(start=21.0, end=22.0, ok=True, pod="b:2"),
    ]
    r = soak_report.request_summary(outcomes, [kill, redis], shed=2)
    assert r["requests"] == 6 and r["ok"] == 2 and r["failed"] == 4
    assert r["in_flight_on_killed_engine"] == 2 and r["in_flight_on_killed_engine_failed"] == 2
    assert r["lost"] == 3 and r["lost_by_cause"] == {"stream_cut": 1, "timeout": 1,
                                                     "http_503": 1}
    assert r["hangs"] == 1 and r["not_sent_at_max_in_flight"] == 2
    assert soak_report.targets(r, []) == {"no_request_lost": False, "no_hang": False,
                                          "rss_flat_within_5pct": None}


def test_rss_is_judged_per_process_after_its_warmup():
    flat = [(t, 11, 100.0 + (t % 3)) for t in range(60)]
    growing = [(t, 12, 100.0 + 2 * t) for t in range(30)]
    # restarted at 30 s, serving (its model loaded) at 40 s: judged from 50 s
    restarted = [(t, 13, 50.0 if t < 40 else 500.0 + (t > 55)) for t in range(30, 60)]
    verdicts = soak_report.rss_verdicts({"picker": flat, "engine-0": growing + restarted},
                                        warmup_s=10, events=[{"target": "engine-0", "t": 29.5,
                                                              "serving_t": 40.0}])
    by_pid = {v["pid"]: v for v in verdicts}
    assert by_pid[11]["flat"] is True and abs(by_pid[11]["growth"]) < 0.05
    assert by_pid[12]["flat"] is False and by_pid[12]["growth"] > 0.2
    assert by_pid[13]["flat"] is True and by_pid[13]["from_s"] == 40.0
    assert by_pid[13]["rss_mib_after_warmup"] == 500.0
    short = soak_report.rss_verdicts({"redis": [(t, 14, 5.0) for t in range(3)]}, 10)
    assert short[0]["flat"] is None  # lived too short after its warm-up to say
    assert soak_report.targets({"lost": 0, "hangs": 0}, verdicts)["rss_flat_within_5pct"] \
        is False


def test_latency_rows_summary_and_plot(tmp_path):
    outcomes = [Outcome(start=s, end=s + 0.5, ok=s != 12, cause="ok" if s != 12 else
                        "stream_cut", ttft=0.1) for s in range(30)]
    rows = soak_report.latency_over_time(outcomes, 30, 10)
    assert [r["sent"] for r in rows] == [10, 10, 10] and rows[1]["errors"] == {"stream_cut": 1}
    assert rows[0]["ttft_ms_p50"] == 100.0 and rows[0]["e2e_ms_p50"] == 500.0
    requests = soak_report.request_summary(outcomes, [], 0)
    rss = soak_report.rss_verdicts({"envoy": [(t, 5, 40.0) for t in range(30)]}, 5)
    report = {"title": "t", "requests": requests, "targets": soak_report.targets(requests, rss),
              "events": [{"target": "engine-0", "t": 10, "restarted_t": 11,
                          "serving_t": 15}], "rss": rss, "over_time": rows,
              "rss_samples": {"envoy": [(t, 5, 40.0) for t in range(30)]}}
    text = soak_report.format_summary(report)
    assert "lost: 1" in text and "engine-0 killed at 10 s" in text and "envoy" in text
    plot_soak(str(tmp_path / "soak.png"), report)
    assert (tmp_path / "soak.png").stat().st_size > 10_000


@pytest.mark.slow  # a whole local stack for a minute, an engine and Redis killed
def test_a_short_soak_loses_nothing_but_the_killed_engines_requests(tiny_chat_model, tmp_path):
    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    args = p.parse_args(["--duration", "0.75", "--rate", "3", "--model", str(tiny_chat_model),
                         "--engine-args", "--num-kv-blocks 256 --max-model-len 1024",
                         "--request-timeout", "30", "--out", str(tmp_path)])
    code = soak.main(args)
    report = json.loads((tmp_path / "soak.json").read_text())
    r = report["requests"]
    assert code == 0, (r, report["events"])
    assert r["lost"] == 0 and r["hangs"] == 0 and r["ok"] >= 0.8 * r["requests"] > 50
    # the engine killed had streams open, and each of them ended with an error
    assert r["in_flight_on_killed_engine"] == r["in_flight_on_killed_engine_failed"] >= 1
    engine, redis = report["events"]
    victim = engine["target"]
    assert victim in ("engine-0", "engine-1") and 15 <= engine["t"] < 20
    assert engine["serving_t"] - engine["t"] < 30  # back and routed to within 30 s
    assert redis["target"] == "redis" and redis["serving_t"] is not None
    assert report["restarts"] == {"redis": 1, "engine-0": 0, "engine-1": 0, "picker": 0,
                                  "envoy": 0, victim: 1}
    assert set(report["rss_samples"]) == {"redis", "engine-0", "engine-1", "picker", "envoy"}
    assert {v["pid"] for v in report["rss"] if v["process"] == victim} == {
        report["rss_samples"][victim][0][1], report["rss_samples"][victim][-1][1]}
    assert (tmp_path / "soak.png").stat().st_size > 10_000
