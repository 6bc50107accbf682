"""Per-request output handling: stop conditions, incremental text, held-back stop prefixes."""

from __future__ import annotations

import logging

from sluice.engine.outputs import RequestOutput, TokenLogprob
from sluice.engine.request import Request

log = logging.getLogger("sluice.engine")


class OutputState:
    """Detokenized text of one request and how much of it has been handed out.

    While a request runs, the last (longest stop string - 1) characters are held
    back: they might be the start of a stop string that must not be shown.
    """

    def __init__(self, req: Request, detokenizer):
        self.req = req
        self.detokenizer = detokenizer  # None: token ids only (no tokenizer)
        self.text = ""
        self.num_sent_chars = 0
        self.max_stop_len = max((len(s) for s in req.params.stop), default=0)
        self.prompt_logprobs_sent = False

    def append_token(self, token: int, max_model_len: int) -> None:
        """Record a sampled token and decide whether the request is finished.

        A stop token or EOS ends the request without adding its text; a stop
        string ends it with the text cut before the stop (kept with
        include_stop_str_in_output) and takes precedence over the length limit.
        Stop strings count only after min_tokens tokens (vLLM: the sampler bans
        stop tokens and EOS until then). A request under a grammar advances its
        matcher here, and ends when the matcher has accepted a stop token (even
        with ignore_eos: the grammar allows nothing after it) or refuses the token.
        """
        req, p = self.req, self.req.params
        req.token_ids.append(token)
        if req.grammar is not None and not req.grammar.accept_token(token):
            log.warning("request %s: token %d is outside its grammar (constraints that "
                        "exclude every token the grammar allows?); finished", req.request_id,
                        token)
            req.finish("stop")
        elif req.grammar is not None and req.grammar.is_terminated:
            req.finish("stop")
        elif token in p.stop_token_ids:
            req.finish("stop", token)
        elif token in req.eos_token_ids and not p.ignore_eos:
            req.finish("stop")
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
            req.finish("length")
        if self.detokenizer is None:
            return
        before = len(self.text)
        if req.finish_reason != "stop":
            self.text += self.detokenizer.add_token(token)
        if req.is_finished:
            self.text += self.detokenizer.finish()
        if p.stop and req.num_output_tokens > p.min_tokens:
            self._check_stop_strings(before)

    def _check_stop_strings(self, before: int) -> bool:
        p = self.req.params
        search_from = max(0, before - self.max_stop_len + 1)
        best = None
        for stop in p.stop:
            idx = self.text.find(stop, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + (len(stop) if p.include_stop_str_in_output else 0)]
        self.req.finish("stop", stop)
        return True

    def make_output(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        req = self.req
        end = len(self.text)
        if not req.is_finished and self.max_stop_len:
            end = max(self.num_sent_chars, end - self.max_stop_len + 1)
        delta = self.text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_tokens,
            new_text=delta,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            new_logprobs=logprobs,
            stop_reason=req.stop_reason,
            prompt_logprobs=self._take_prompt_logprobs(),
        )

    def _take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs, once: with the request's first output."""
        if self.prompt_logprobs_sent or self.req.params.prompt_logprobs is None:
            return None
        self.prompt_logprobs_sent = True
        return list(self.req.prompt_logprobs or [None])
