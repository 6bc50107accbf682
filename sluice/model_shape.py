"""A model's shape as tensor parallelism sees it, and vLLM's rule for the sizes that split
it: heads and the MLP evenly, key/value heads evenly or replicated (the size a multiple of
them). The operator's CRD and checks read it here (they never import the engine); the
engine applies the same rule in `sluice.engine.distributed.parallel_state` (a test
compares the two). A leaf module: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Hugging Face config.json that a tensor-parallel split divides."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    def splits(self, size: int) -> bool:
        kv = self.num_key_value_heads
        return (self.num_attention_heads % size == 0 and self.intermediate_size % size == 0
                and (kv % size == 0 if kv >= size else size % kv == 0))

    def sizes(self, most: int) -> tuple[int, ...]:
        """Every tensor-parallel size up to `most` that splits the model."""
        return tuple(n for n in range(1, most + 1) if self.splits(n))
