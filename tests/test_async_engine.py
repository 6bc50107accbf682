"""The engine loop beside asyncio: early close aborts, a crashed loop fails every stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.engine.async_engine import AsyncEngine, EngineDeadError
from sluice.engine.config import CacheConfig, EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)


def make() -> AsyncEngine:
    llm = LLMEngine(EngineConfig(model="tiny-llama", served_model_name="t", load_format="dummy",
                                 cache=CacheConfig(num_blocks=128)))
    return AsyncEngine(llm)


def wait_until(cond, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def test_closing_the_stream_aborts_and_frees_blocks():
    engine = make()

    async def run():
        stream = engine.generate("a", [1, 2, 3, 4, 5], LONG)
        first = await stream.__anext__()
        assert first.new_token_ids and not first.finished
        await stream.aclose()

    asyncio.run(run())
    kv = engine.engine.kv
    assert wait_until(lambda: kv.num_free_blocks == kv.num_blocks and not engine.engine.requests)
    engine.shutdown()


def test_validation_error_raised_before_first_output():
    engine = make()

    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            async for _ in engine.generate("big", [1] * 5000, LONG):
                pass

    asyncio.run(run())
    assert engine._num_pending == 0
    engine.shutdown()


def test_crashed_loop_fails_streams_and_new_requests():
    engine = make()
    real_step = engine.engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("device lost")
        return real_step()

    engine.engine.step = failing_step

    async def run():
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in engine.generate("a", [1, 2, 3], LONG):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("b", [1, 2, 3], LONG):
                pass

    asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert engine.error is not None


def test_reset_prefix_cache_clears_hashes_and_publishes():
    llm = LLMEngine(EngineConfig(model="tiny-llama", served_model_name="t", load_format="dummy",
                                 cache=CacheConfig(num_blocks=128, block_size=4)),
                    record_kv_events=True)
    published = []
    engine = AsyncEngine(llm, on_step=lambda: published.extend(llm.kv.take_events()))

    async def run():
        async for _ in engine.generate("a", list(range(1, 20)),
                                       SamplingParams(max_tokens=2, temperature=0)):
            pass
        assert llm.kv.cached, "the prompt's full blocks are cached"
        assert await engine.reset_prefix_cache() is True

    asyncio.run(run())
    assert not llm.kv.cached
    assert type(published[-1]).__name__ == "AllBlocksCleared"
    llm.kv.check_invariants()
    engine.shutdown()
