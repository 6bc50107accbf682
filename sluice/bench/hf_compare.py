"""The same latency measurement on Hugging Face transformers `generate` (static cache).

Used by `sluice bench engine --mode latency --compare hf`: transformers builds
the model first (random weights for dummy shapes, or the checkpoint), the
engine then loads exactly those weights, so both run the same computation.
"""

from __future__ import annotations

import random
import time

import torch


def build_hf_model(hf_config: dict, model_path: str | None, dtype: torch.dtype,
                   device: torch.device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_path is not None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**hf_config)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def hf_weights(model):
    """(name, tensor) pairs under transformers' names, as the engine loader expects."""
    for name, tensor in model.state_dict().items():
        if "rotary_emb" not in name:
            yield name, tensor


@torch.inference_mode()
def hf_latency(model, input_len: int, output_len: int, batch_size: int, seed: int) -> dict:
    """TTFT = generate 1 token; TPOT = (time for output_len tokens - TTFT) / (output_len - 1)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(input_len)]
                        for _ in range(batch_size)], device=device)
    kwargs = {"do_sample": False, "cache_implementation": "static", "pad_token_id": 0,
                  "eos_token_id": None}

    def timed(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(device)
        return time.perf_counter() - t0

    timed(2)  # warm-up (allocates the static cache)
    ttft = timed(1)
    total = timed(output_len)
    tpot = (total - ttft) / max(output_len - 1, 1)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
