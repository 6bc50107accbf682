"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from sluice.engine.kv_transfer.params import KVTransferParams
from sluice.engine.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how to pick each token.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0
    disable those filters. `logprobs` is the number of top alternatives to
    return with each sampled token (None: no logprobs at all; 0: only the
    sampled token's own logprob). `seed` makes a request's samples reproducible
    independent of what else runs in the batch.

    Constraints on the next token (vLLM's order, `logits_processors.py`), applied
    after the raw logprobs are taken: `allowed_token_ids` (only these), `bad_words_token_ids`
    (a word's last token is banned where the output ends with the rest of it),
    `min_tokens` (EOS and stop tokens banned until that many tokens were generated;
    stop strings are not checked either), `logit_bias` ((token, bias) added to the
    logit). `structured_outputs` constrains the whole output (a grammar); its mask
    comes first, before the logprobs, as vLLM applies it. `prompt_logprobs`: the
    number of top alternatives returned with each prompt token's logprob (None: none).
    `skip_special_tokens` / `spaces_between_special_tokens`: how output text is
    detokenized (the latter matters only to decoders that put spaces between
    special tokens; byte-level BPE vocabularies render the same either way).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # disaggregated prefill/decode (vLLM carries it in extra_args; kv_transfer/params.py)
    kv_transfer_params: KVTransferParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @cached_property
    def constrains_logits(self) -> bool:
        """Whether `logits_processors.apply_logits_processors` has work for this request."""
        return bool(self.min_tokens or self.logit_bias or self.bad_words_token_ids
                    or self.allowed_token_ids is not None)

    @cached_property
    def index_tensors(self) -> dict:
        """CPU tensors of the id lists the sampler applies on every step, built once:
        "allowed" (allowed_token_ids), "bias_ids" and "bias" (logit_bias), "banned"
        (single-token bad words)."""
        import torch

        out = {}
        if self.allowed_token_ids is not None:
            out["allowed"] = torch.tensor(self.allowed_token_ids, dtype=torch.long)
        if self.logit_bias:
            out["bias_ids"] = torch.tensor([t for t, _ in self.logit_bias], dtype=torch.long)
            out["bias"] = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32)
        out["banned"] = [w[0] for w in self.bad_words_token_ids if len(w) == 1]
        return out

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for invalid values."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: token {token} with bias {bias}; token ids are "
                                 f"non-negative and biases in [-100, 100]")
        if any(not word or min(word) < 0 for word in self.bad_words_token_ids):
            raise ValueError("bad_words: every word needs at least one valid token id")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
