"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time

import torch

from sluice.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its KV is loading from another engine
    FINISHED = "finished"


class Request:
    """Tokens known so far (prompt + output) and how many of them have K/V in the cache.

    Invariant: 0 <= num_computed_tokens <= num_tokens. A request samples a new
    token in a step exactly when that step brings num_computed_tokens to
    num_tokens.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), cache_salt: str | None = None,
                 arrival_time: float | None = None, priority: int = 0, lora=None):
        assert prompt_token_ids, "a request needs at least one prompt token"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.lora = lora  # lora.manager.LoRARequest: the adapter it runs with (None: base)
        # (prefixed: no salt a client chooses can equal an adapter's key)
        self.extra_keys: tuple[str, ...] = (((f"salt:{cache_salt}",) if cache_salt else ())
                                            + ((lora.cache_key,) if lora else ()))
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling (-1: not yet)
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.grammar = None  # structured_output.grammar.RequestGrammar, when constrained
        self.prompt_logprobs: list | None = None  # prompt_logprobs.py fills it, when asked
        # Draft tokens proposed for the next step (spec_decode/); never part of token_ids
        # until verified, so never hashed into the prefix cache or published as KV events.
        self.spec_token_ids: list[int] = []
        # The draft distribution q each draft was sampled from ([drafts, vocab]); None:
        # drafted greedily (point masses). Aligned with spec_token_ids' first entries.
        self.spec_draft_probs = None
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # vLLM's: lower is served first (sched_policy.py)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
