"""The host-side inputs of one forward step: everything a tensor-parallel rank needs to
run it as rank 0 does (vLLM's scheduler output, reduced to the model's inputs). Rank 0
builds it from the scheduled requests and broadcasts it; every rank runs the model on it
and computes the logits of each row set in `logit_rows` (rank 0 keeps them)."""

from __future__ import annotations

import msgspec


class StepInput(msgspec.Struct, array_like=True):
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's KV-cache slot
    query_start_loc: list[int]  # sequence i's rows: [query_start_loc[i], [i + 1])
    seq_lens: list[int]  # each sequence's length after the step
    block_tables: list[list[int]]
    logit_rows: list[list[int]]  # row sets whose logits are computed, in order

    @property
    def is_decode(self) -> bool:
        """One token per sequence."""
        return len(self.input_ids) == len(self.seq_lens)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(StepInput)
