"""`sluice bench engine --mode spec --speculative-config JSON`: speculative decoding against
no speculation, in the same run, on the issue's two workloads.

(a) input-grounded: edit or summarise a given code block or text, so the answer copies
    spans of the prompt (where n-gram lookup shines);
(b) open chat: questions whose answers are not in the prompt.
Each workload runs greedy (ignore_eos, --output-len tokens) at batch 1 (the prompts one
after the other) and at --batch-size requests at once (the prompts repeated), on an
engine without speculation and one with it, alternately, --spec-reps times each
(the best of each counts). Reported per cell: output tok/s of
both and their ratio; for the speculative engine the mean acceptance length
(1 + accepted / drafts, vLLM's definition), the acceptance rate (accepted / draft
tokens) and the acceptance at each draft position (accepted at i / drafts), and how
many greedy outputs are identical to the plain engine's: all of them in float32 (the
tests assert it); in bfloat16 the verification's several-token kernels round
differently from a one-token decode, so a near-tie can flip and the outputs diverge
from there (each is still the target's greedy output under its own rounding).
Needs a model with a tokenizer (the default model on CPU).
"""

from __future__ import annotations

import dataclasses
import time

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''
TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
        "Supporters said the lanes would make cycling safer and reduce traffic. Shop owners "
        "worried that removing parking spaces would hurt their business. The council agreed "
        "to run a six-month trial and to count cyclists and customers before deciding.")
GROUNDED = [
    (f"Rename the function to rolling_mean and the variable total to running_sum. Return the "
    f"whole code.\n\n```python\n{CODE}```"),
    f"Add type hints to this function and return the complete code.\n\n```python\n{CODE}```",
    f"Repeat the following text, replacing 'council' with 'committee':\n\n{TEXT}",
    f"Summarise this news text in two sentences, reusing its wording:\n\n{TEXT}",
]
CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the benefits of learning a second language? Give several reasons.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "Suggest a weekend plan for a rainy Saturday in a small town.",
]


def run_spec(config, args) -> dict:
    from sluice.engine.llm_engine import LLMEngine
    from sluice.tokenizer import Tokenizer

    if config.speculative is None:
        raise SystemExit("--mode spec needs --speculative-config")
    tok = Tokenizer.from_path(config.model)
    workloads = {"grounded": GROUNDED, "chat": CHAT}
    prompts = {name: [tok.encode_chat([{"role": "user", "content": c}]) for c in contents]
               for name, contents in workloads.items()}
    engines = {"plain": LLMEngine(dataclasses.replace(config, speculative=None), tok),
               "spec": LLMEngine(config, tok)}
    for llm in engines.values():
        _generate(llm, [prompts["chat"][0]], 8)  # warm-up
    result: dict = {"speculative_config": dataclasses.asdict(config.speculative)}
    for name, ps in prompts.items():
        for batch in (1, args.batch_size):
            cell = f"{name}_b{batch}"
            batch_prompts = ps if batch == 1 else [ps[i % len(ps)] for i in range(batch)]
            best = {"plain": 0.0, "spec": 0.0}
            outs = {}
            before = _spec_counts(engines["spec"])
            # Alternate the two engines, best of --spec-reps each: the shared machine's
            # load drifts by tens of percent over minutes, the same within one pair.
            for _ in range(args.spec_reps):
                for label, llm in engines.items():
                    start = time.perf_counter()
                    if batch == 1:
                        outs[label] = [_generate(llm, [p], args.output_len)[0] for p in ps]
                    else:
                        outs[label] = _generate(llm, batch_prompts, args.output_len)
                    tok_s = sum(len(o) for o in outs[label]) / (time.perf_counter() - start)
                    best[label] = max(best[label], tok_s)
            result[f"{cell}_plain_tok_s"] = best["plain"]
            result[f"{cell}_spec_tok_s"] = best["spec"]
            result[f"{cell}_speedup"] = best["spec"] / best["plain"]
            result.update(_acceptance(cell, before, _spec_counts(engines["spec"])))
            same = sum(a == b for a, b in zip(outs["plain"], outs["spec"]))
            result[f"{cell}_identical_outputs"] = f"{same}/{len(outs['plain'])}"
    return result


def _generate(llm, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    from sluice.engine.sampling_params import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                ignore_eos=True))


def _spec_counts(llm) -> tuple[float, float, float, list[float]]:
    m = llm.metrics
    k = llm.config.speculative.num_speculative_tokens if llm.config.speculative else 0
    per_pos = [m._spec_per_pos.labels(m._model_name, str(i))._value.get() for i in range(k)]
    return (m.spec_drafts._value.get(), m.spec_draft_tokens._value.get(),
            m.spec_accepted._value.get(), per_pos)


def _acceptance(cell: str, before, after) -> dict:
    drafts, tokens, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    per_pos = [a - b for a, b in zip(after[3], before[3])]
    return {f"{cell}_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            f"{cell}_acceptance_rate": accepted / tokens if tokens else 0.0,
            f"{cell}_acceptance_per_pos": [round(p / drafts, 3) if drafts else 0.0
                                           for p in per_pos]}
