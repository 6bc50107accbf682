"""What rank 0 publishes to the other tensor-parallel ranks (workers.py), one message per
collective they join:
- `StepInput`: one forward step's host-side inputs, everything a rank needs to run it as
  rank 0 does (vLLM's scheduler output, reduced to the model's inputs). Every rank runs
  the model on it and computes the logits of each row set in `logit_rows` (rank 0 keeps
  them). Rank 0 builds it for its own forward too, at any tensor-parallel size.
- `GatherKV` / `ScatterKV`: KV blocks moved whole-headed between rank 0 and the ranks'
  shards, for a KV transfer (kv_shards.py).
An empty message stops the workers."""

from __future__ import annotations

import msgspec


class StepInput(msgspec.Struct, tag="step", array_like=True):
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's KV-cache slot
    query_start_loc: list[int]  # sequence i's rows: [query_start_loc[i], [i + 1])
    seq_lens: list[int]  # each sequence's length after the step
    block_tables: list[list[int]]
    logit_rows: list[list[int]]  # row sets whose logits are computed, in order
    num_layers: int = 0  # run the first this many layers only (an early-exit draft); 0: all

    @property
    def is_decode(self) -> bool:
        """One token per sequence."""
        return len(self.input_ids) == len(self.seq_lens)


class GatherKV(msgspec.Struct, tag="gather_kv", array_like=True):
    block_ids: list[int]  # every rank sends its heads of these blocks to rank 0


class ScatterKV(msgspec.Struct, tag="scatter_kv", array_like=True):
    block_ids: list[int]  # rank 0 broadcasts these blocks' heads; each rank keeps its own


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(StepInput | GatherKV | ScatterKV)
