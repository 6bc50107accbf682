"""The vocabulary split over the tensor-parallel ranks, as vLLM's VocabParallelEmbedding
and ParallelLMHead: rank r holds rows [r x per, (r + 1) x per) of the embedding (per =
ceil(vocab / tp); rows past the vocabulary are zero padding).

- Embedding: each rank looks up the ids in its range and zeroes the others; one
  all-reduce sums the ranks' rows (exactly one rank contributes each id's row).
- LM head: each rank computes its vocabulary slice's logits; they are gathered on rank 0
  (the rank that samples) and the padding is cut.
A tied LM head shares the embedding's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.distributed.parallel_state import TPGroup
from sluice.engine.layers.linear import Linear
from sluice.engine.layers.parallel_linear import check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        self.per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size))

    def weight_loader(self, param: str, full, part: str) -> None:
        """This rank's rows of the full [vocab, hidden] checkpoint tensor (or slice)."""
        check_shape(full, (self.vocab_size, self.hidden_size), f"{part}.{param}")
        with torch.no_grad():
            self.weight[:self.end - self.start].copy_(full[self.start:self.end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(Linear):
    """logits = hidden W^T over the whole vocabulary, on rank 0 (None elsewhere); each rank
    runs `Linear`'s kernel over its vocabulary rows."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool):
        super().__init__(embedding.hidden_size, embedding.per_rank)
        # (the embedding's range, not the module: it is the model's, not a submodule here)
        self.vocab_size, self.start, self.end = embedding.vocab_size, embedding.start, embedding.end
        self.tp = embedding.tp
        if tied:
            self.weight = embedding.weight

    def weight_loader(self, param: str, full, part: str) -> None:
        check_shape(full, (self.vocab_size, self.in_features), f"{part}.{param}")
        with torch.no_grad():
            self.weight[:self.end - self.start].copy_(full[self.start:self.end])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather(self.matmul(hidden, None), dim=-1)
        return None if logits is None else logits[..., :self.vocab_size]
