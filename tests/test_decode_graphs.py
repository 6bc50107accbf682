"""Decode steps through the padded static buffers of the CUDA-graph runner.

On CPU the runner replays nothing (capture=False) but runs the exact padded
path a captured graph replays, with the Triton backend in Triton's interpreter:
greedy tokens must equal the eager PyTorch path's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_models import tiny_config

from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # an engine through Triton's interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def engine(folder, backend: str, graphs: bool) -> LLMEngine:
    llm = LLMEngine(EngineConfig(
        model=str(folder), served_model_name="tiny", load_format="dummy", dtype="float32",
        device=DEVICE, attention_backend=backend, enforce_eager=not graphs,
        cache=CacheConfig(block_size=8, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64)))
    if graphs and llm.runner.decode_graphs is None:  # CPU: same padded path, not captured
        llm.runner.enable_decode_graphs(5, llm.max_model_len, capture=False)
    return llm


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_decode_equals_eager(family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(family)))
    rnd = random.Random(1)
    # 7 requests, at most 5 running: decode batches of 5, 4, 3, ...; 3 pads to 4, and as
    # requests finish the padded tail rows change between steps.
    prompts = [[rnd.randrange(3, 512) for _ in range(rnd.randint(3, 30))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rnd.randint(3, 9), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    with_graphs = engine(tmp_path, "triton", graphs=True)
    runner = with_graphs.runner.decode_graphs
    batches = []
    original = runner.run

    def counting_run(input_ids, *args):
        batches.append(len(input_ids))
        return original(input_ids, *args)

    runner.run = counting_run
    got = with_graphs.generate(prompts, params)
    assert 3 in batches and 5 in batches, batches
    assert with_graphs.runner.decode_graphs.sizes == [1, 2, 4, 5]
    assert got == engine(tmp_path, "torch", graphs=False).generate(prompts, params)
