"""What the prefix scorers share: the prompt's request keys per key group, and the
hits they predict per candidate."""

from __future__ import annotations

from collections.abc import Iterator

from sluice.gateway.prompt.block_keys import request_keys
from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugins import RoutingRequest


def key_groups(req: RoutingRequest, cands: list[Candidate], limit: int | None = None
               ) -> Iterator[tuple[list[str], list[Candidate]]]:
    """(The prompt's request keys, the candidates keyed alike) per key group (key seed,
    block size): made once per request (`req.keys_by`), at most `limit` keys."""
    groups: dict[tuple[str, int], list[Candidate]] = {}
    for c in cands:
        groups.setdefault(c.key_group, []).append(c)
    for group, members in groups.items():
        keys = req.keys_by.get(group)
        if keys is None:
            keys = req.keys_by[group] = request_keys(group[0], group[1], req.token_ids)
        yield (keys if limit is None else keys[:limit]), members


def set_hits(members: list[Candidate], hits: dict[str, int],
             held: dict[str, int] | None = None) -> None:
    for c in members:
        # the engine always computes the prompt's last token (its logits are sampled),
        # so a block-aligned prompt reuses one block less than it holds
        reusable = (c.prompt_tokens - 1) // c.block_size if c.prompt_tokens else 0
        c.hit_blocks = min(hits.get(c.pod, 0), reusable)
        if held is not None:
            c.held_blocks = held.get(c.pod, 0)


def hit_fraction(cands: list[Candidate]) -> list[float]:
    """score = predicted hit blocks / the prompt's full blocks (0 for an empty prompt)."""
    return [c.hit_blocks / c.total_blocks if c.total_blocks else 0.0 for c in cands]
