"""A step's grammar masks, filled and applied in one batched call each.

xgrammar fills the allowed-token bitmask of every constrained row in C++ (one call
for the batch, its own thread pool); the forbidden logits of those rows then become
-inf in place. On CUDA xgrammar's Triton kernel does that. On the CPU its C++ kernel
writes token by token (3.1 ms for 16 rows of a 49k vocabulary when most tokens are
forbidden, as in JSON), so the bits are unpacked by numpy instead and added as a
0 / -inf bias over the span of rows from the first constrained one to the last
(1.0 ms for the same 16 rows): an unconstrained row inside the span has an all-ones
mask and gets exactly +0. A batch without constrained rows never comes here.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from sluice.engine.structured_output.grammar import RequestGrammar

_batch_matcher = None
_batch_matcher_lock = threading.Lock()


def apply_grammar_bitmask(logits: torch.Tensor, grammars: list[RequestGrammar],
                          rows: list[int]) -> None:
    """Mask, in place, the logits each grammar forbids: grammars[i] constrains logits[rows[i]].

    `logits` is [batch, vocab] float32; vocab is the model's logits width, which the
    grammars were compiled for (`StructuredOutputManager(vocab_size=...)`).
    """
    import xgrammar as xgr

    assert len(grammars) == len(rows) and rows, "one row per grammar"
    vocab = logits.shape[1]
    bitmask = torch.full((logits.shape[0], (vocab + 31) // 32), -1, dtype=torch.int32)
    _get_batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars],
                                                       bitmask, rows)
    if logits.device.type == "cpu":
        lo, hi = min(rows), max(rows) + 1
        _add_mask_bias(logits[lo:hi], bitmask[lo:hi])
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)


def _add_mask_bias(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits += 0 where the token's bit is set, -inf where it is clear (in place).

    Bit j of int32 word w is token 32 w + j: on a little-endian machine that is bit
    j % 8 of byte 4 w + j // 8, numpy's bitorder "little". The bias is built without
    a branch per token: (bit - 1) is 0 or -1; times the dtype's max, twice, it stays 0
    or overflows to -inf."""
    assert sys.byteorder == "little" and logits.dtype.is_floating_point
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    bias = torch.from_numpy(bits[:, :vocab]).to(logits.dtype)
    big = torch.finfo(logits.dtype).max
    logits.add_(bias.sub_(1.0).mul_(big).mul_(big))


def _get_batch_matcher():
    global _batch_matcher
    with _batch_matcher_lock:
        if _batch_matcher is None:
            import xgrammar as xgr

            _batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")
        return _batch_matcher
