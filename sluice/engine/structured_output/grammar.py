"""One request's position in its grammar: an xgrammar `GrammarMatcher` and its contract.

Contract with the engine:
- the sampler asks for the next token's bitmask (`fill_bitmask`) before sampling;
- every sampled token is accepted (`accept_token`) before the next step's bitmask is
  filled (the output processor does it when it appends the token);
- a token the matcher refuses (only possible when other constraints masked every
  token the grammar allows) ends the request; once the matcher has accepted a stop
  token (`is_terminated`) nothing more may be generated.

Speculative decoding (not built yet) is planned for: xgrammar's matcher rolls back
any number of accepted tokens. A proposer's k draft tokens are checked with
`validate_tokens`, which accepts as many as the grammar allows and rolls them back,
so the state is unchanged. The verifier fills one bitmask row per draft position the
same way (fill row 0, accept draft token 0, fill row 1, ..., then `rollback` all of
them), samples every position with its row, and accepts the tokens it keeps.
"""

from __future__ import annotations

import torch


class RequestGrammar:
    """A compiled grammar's matcher for one request (one choice of an n > 1 request)."""

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar refuses it."""
        ok = self.matcher.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 on the CPU, bit set: allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the grammar allows nothing more."""
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        assert 0 <= num_tokens <= self.num_accepted, "cannot roll back more than was accepted"
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from here; state unchanged."""
        accepted = 0
        for token in tokens:
            if not self.accept_token(token):
                break
            accepted += 1
        self.rollback(accepted)
        return tokens[:accepted]
