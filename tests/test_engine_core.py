"""The engine core in its own process: messages, the client's streams, and failure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from engine_server import EngineProcess

from sluice.engine.async_engine import EngineDeadError
from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.core.client import EngineCoreClient
from sluice.engine.core.messages import (
    AddRequest,
    Outputs,
    command_decoder,
    encoder,
    event_decoder,
)
from sluice.engine.core.process import CoreSpec, native_library_defaults
from sluice.engine.llm_engine import PromptTooLongError
from sluice.engine.outputs import RequestOutput, TokenLogprob
from sluice.engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def test_messages_carry_sampling_params_and_outputs_intact():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, stop=("x", "yz"),
                            stop_token_ids=(5,), logprobs=2, seed=11)
    cmd = command_decoder.decode(encoder.encode(AddRequest("r", [1, 2], params, None, 1.5)))
    assert cmd == AddRequest("r", [1, 2], params, None, 1.5)
    assert isinstance(cmd.params.stop, tuple)
    out = RequestOutput("r", [4], "a", True, "stop", 2, 1, 0,
                        [TokenLogprob(4, -0.25, ((4, -0.25), (9, -2.0)))], stop_reason="x")
    event = event_decoder.decode(encoder.encode(Outputs([out], 3, b"m 1\n")))
    assert event == Outputs([out], 3, b"m 1\n")


def test_params_are_validated_again_on_arrival():
    """The core never trusts a message: an invalid SamplingParams does not decode."""
    raw = encoder.encode(AddRequest("r", [1], SamplingParams(), None, 0.0))
    payload = msgspec.msgpack.decode(raw)
    payload[3]["max_tokens"] = 0
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        command_decoder.decode(msgspec.msgpack.encode(payload))


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(model="tiny-llama", served_model_name="t", load_format="dummy",
                          cache=CacheConfig(num_blocks=64, block_size=4),
                          scheduler=SchedulerConfig(max_model_len=256, max_waiting_requests=8))
    c = EngineCoreClient(CoreSpec(config, None, 1, None, "", "", "WARNING"))
    yield c
    c.shutdown()


def test_streams_and_metrics_through_the_core(client):
    assert client.info.max_model_len == 256 and client.info.served_model_name == "t"

    async def run():
        outs = [o async for o in client.generate("a", [1, 2, 3, 4, 5],
                                                 SamplingParams(max_tokens=6, temperature=0))]
        return outs

    outs = asyncio.run(run())
    assert [len(o.new_token_ids) for o in outs] == [1] * 6 and outs[-1].finished
    assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == 5
    # The finishing step carried the metrics: the request is counted as soon as it ends.
    assert b'vllm:request_success_total{finished_reason="length",model_name="t"} 1.0' in (
        client.metrics_text())


def test_validation_errors_and_early_close(client):
    async def run():
        with pytest.raises(PromptTooLongError, match="maximum context length"):
            async for _ in client.generate("big", [1] * 300, LONG):
                pass
        stream = client.generate("b", [1, 2, 3], LONG)
        first = await stream.__anext__()
        assert not first.finished
        assert client.waiting_room() == 8
        await stream.aclose()  # aborts in the core

    asyncio.run(run())
    assert client.waiting_room() == 8 and not client._live


def test_overload_is_refused_before_the_core(client):
    async def run():
        streams = [client.generate(f"w{i}", [1, 2, 3], LONG) for i in range(8)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        assert all(not f.finished for f in firsts)
        # 8 live requests, all running: the waiting room is full only of what waits.
        assert client.waiting_room() == 8
        for s in streams:
            await s.aclose()

    asyncio.run(run())


def test_reset_prefix_cache_answers(client):
    assert asyncio.run(client.reset_prefix_cache()) is True


def test_a_dead_core_fails_every_stream_and_says_so():
    config = EngineConfig(model="tiny-llama", served_model_name="t", load_format="dummy",
                          cache=CacheConfig(num_blocks=64))
    dead = []
    c = EngineCoreClient(CoreSpec(config, None, 1, None, "", "", "WARNING"),
                         on_dead=lambda: dead.append(1))

    async def run():
        stream = c.generate("a", [1, 2, 3], LONG)
        await stream.__anext__()
        os.kill(c._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            async for _ in c.generate("b", [1, 2, 3], LONG):
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
        deadline = time.monotonic() + 10
        while not dead and time.monotonic() < deadline:  # called on the reader thread
            time.sleep(0.01)
        assert dead == [1] and c.error is not None
    finally:
        c.shutdown()


def _core_of(pid: int) -> int:
    """The engine core among the server's children (multiprocessing also starts its
    resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    cores = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(child)
    assert len(cores) == 1, f"one engine core expected among {children}"
    return cores[0]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True  # exited, not yet reaped
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


ENGINE_ARGS = ("--model", "tiny-llama", "--load-format", "dummy", "--num-kv-blocks", "64")


def test_the_server_exits_when_its_core_dies():
    engine = EngineProcess(*ENGINE_ARGS).wait_ready()
    try:
        core = _core_of(engine.proc.pid)
        os.kill(core, signal.SIGKILL)
        assert engine.proc.wait(timeout=30) == 1  # for the supervisor: restart me
    finally:
        engine.stop()


def test_the_core_dies_with_its_server():
    engine = EngineProcess(*ENGINE_ARGS).wait_ready()
    try:
        core = _core_of(engine.proc.pid)
        engine.proc.kill()
        engine.proc.wait()
        assert _gone(core, 15), "an orphaned core would hold the model and the port's work"
    finally:
        engine.stop()


def test_native_library_defaults_leave_what_the_user_set():
    env: dict[str, str] = {}
    native_library_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "3000000", "LRU_CACHE_CAPACITY": "32",
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}
    # A chosen wait policy decides the spin itself; a chosen spin count stays.
    for given in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"},
                  {"LRU_CACHE_CAPACITY": "1024"}):
        env = dict(given)
        native_library_defaults(env)
        assert all(env[k] == v for k, v in given.items())
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    native_library_defaults(env)
    assert "GOMP_SPINCOUNT" not in env


def test_the_core_process_module_loads_no_torch():
    """OpenMP reads its variables when torch loads it: the core sets them first."""
    code = ("import sys, sluice.cli, sluice.engine.core.process; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
