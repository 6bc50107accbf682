"""`sluice up --prefill N --decode M`: disaggregated prefill/decode on one machine, end to end
through Envoy and the picker (real engines, tiny float32 model, loopback); and the engine
shapes `sluice up` accepts."""

import os
import signal
import subprocess
import sys

import httpx
import pytest
from engine_server import EngineProcess
from polling import wait_for
from test_local_up import start_up, wait_healthy

from sluice.local.cli import shape_error
from sluice.local.roles import engine_roles

ENGINE_ARGS = ("--dtype float32 --num-kv-blocks 256 --block-size 16 --max-model-len 1024 "
               "--max-num-batched-tokens 64")
LONG = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(40))  # ~280 tokens
SHORT = "The quick brown fox"
PULLED = ("sluice:kv_transfer_requests_total", 'outcome="pulled"')
RECEIVED = ("sluice:kv_transfer_bytes_total", 'direction="received"')


def metric(pod: str, name: str, label: str = "") -> float:
    """Sum of an engine's samples of `name` whose labels hold `label` (/metrics is open)."""
    text = httpx.get(f"http://{pod}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120, headers=headers, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.slow  # a whole stack (two engines, picker, Envoy, Redis) and a reference engine
def test_up_prefill_decode_serves_long_prompts_disaggregated(tiny_chat_model):
    # the aggregated reference: a plain engine, same weights and numerics, started meanwhile
    reference = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", "tiny",
                              *ENGINE_ARGS.split())
    proc, url = start_up(tiny_chat_model, 0, ENGINE_ARGS, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                         shape=("--prefill", "1", "--decode", "1"))
    try:
        wait_healthy(proc, url)
        reference.wait_ready()
        pods = list(httpx.get(url + "/health").json()["pods"])
        assert len(pods) == 2
        before = {p: (metric(p, *PULLED), metric(p, *RECEIVED)) for p in pods}

        r = complete(url, LONG)
        decode, prefill = r.headers["x-sluice-pod"], r.headers.get("x-sluice-prefill-pod")
        assert r.headers["x-sluice-pd"] == "prefill" and {decode, prefill} == set(pods)
        expected = complete(reference.url, LONG).json()["choices"][0]["text"]
        assert r.json()["choices"][0]["text"] == expected  # token for token
        # the prefill engine served the prefill: the decode engine pulled its blocks (the
        # counters reach /metrics with the engine core's next metrics message: polled)
        wait_for(lambda: metric(prefill, *PULLED) == before[prefill][0] + 1, timeout=10,
                 what="the prefill pod counts the pull")
        wait_for(lambda: metric(decode, *RECEIVED) > before[decode][1], timeout=10,
                 what="the decode pod counts the bytes received")
        assert metric(decode, "sluice:kv_transfer_prefill_leg_failures_total") == 0
        assert metric(decode, "sluice:kv_transfer_fallbacks_total") == 0

        moved = (metric(prefill, *PULLED), metric(decode, *RECEIVED))
        # below the picker's threshold: the decode engine prefills, whatever prefill pod the
        # client names (Envoy strips the header on the picker's word)
        r = complete(url, SHORT, {"x-prefiller-host-port": prefill})
        assert (r.headers["x-sluice-pod"], r.headers["x-sluice-pd"]) == (decode, "short")
        assert "x-sluice-prefill-pod" not in r.headers
        assert r.json()["choices"][0]["text"] == \
            complete(reference.url, SHORT).json()["choices"][0]["text"]
        assert (metric(prefill, *PULLED), metric(decode, *RECEIVED)) == moved  # no transfer
    finally:
        reference.stop()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    log = out.decode()
    assert proc.returncode == 0, log[-3000:]
    for name in ("prefill-0", "decode-0", "picker", "envoy"):
        assert any(line.startswith(f"{name:<10}| ") for line in log.splitlines()), name


def test_engine_shapes():
    assert [(r.name, r.role) for r in engine_roles(2)] == [("engine-0", None),
                                                          ("engine-1", None)]
    roles = engine_roles(0, prefill=1, decode=2)
    assert [(r.name, r.role, r.destination) for r in roles] == [
        ("prefill-0", "prefill", False), ("decode-0", "decode", True),
        ("decode-1", "decode", True)]
    assert '"kv_role": "kv_producer"' in roles[0].argv[1]
    assert '"kv_role": "kv_consumer"' in roles[1].argv[1]
    assert shape_error(None, 0, 0) is None and shape_error(3, 0, 0) is None
    assert shape_error(None, 1, 2) is None
    assert "mutually exclusive" in shape_error(2, 1, 1)
    assert "both at least 1" in shape_error(None, 1, 0)


def test_up_refuses_engines_with_prefill_decode():
    """The CLI says why and starts nothing."""
    for args in (["--engines", "2", "--prefill", "1", "--decode", "1"], ["--prefill", "1"]):
        r = subprocess.run([sys.executable, "-m", "sluice.cli", "up", *args],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 2 and "sluice up:" in r.stderr, r.stderr
        assert ("mutually exclusive" if "--engines" in args else "--decode M") in r.stderr
