"""Paged KV-cache block pool with automatic prefix caching.

Ownership (asserted by `check_invariants`):
- every block is either referenced (ref_cnt > 0, in at least one request's
  block table) or in the free queue (ref_cnt == 0) — never both, never neither;
- ref_cnt[b] equals the number of block tables that contain b;
- `cached` maps a block hash to the one block holding it, and block_hash[b] is
  that hash; a free block may keep its hash (a cache hit revives it) until it
  is handed out again, which evicts the hash (BlockRemoved).
Eviction is LRU over the free queue: freeing appends a request's blocks tail
first, so a prefix's last blocks go before its first; blocks with no hash are
put at the front, since reusing them loses nothing. Only full blocks are cached.
"""

from __future__ import annotations

from collections import OrderedDict

from sluice.engine.block_hash import extend_block_hashes
from sluice.engine.request import Request
from sluice.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.record_events = record_events
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.events: list = []

    # -- queries ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached full blocks from the start of req's tokens.

        Never covers the last token: its logits must be computed to sample.
        """
        if not self.enable_prefix_caching:
            return []
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.extra_keys)
        blocks = []
        for h in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0, cache: bool = True) -> bool:
        """Make req's block table cover num_computed_tokens (+ hits) + num_new_tokens.

        `computed_blocks` (prefix hits) may only be passed for a request holding
        no blocks. Returns False, changing nothing, when the pool cannot supply
        the blocks; the caller then preempts or waits. `num_lookahead_tokens`
        (speculative drafts, vLLM's name) get slots too but are never hashed:
        only tokens up to num_computed_tokens + num_new_tokens are committed.
        `cache=False`: the new blocks' K/V arrives later (a load from another engine,
        kv_transfer/), so they are not hashed yet: no request may hit them before
        `cache_blocks`.
        """
        computed = computed_blocks or []
        rid = req.request_id
        held = self.req_blocks.get(rid, [])
        assert not (computed and held), "prefix hits are only taken at admission"
        num_total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        assert num_total <= req.num_tokens
        num_slots = num_total + num_lookahead_tokens
        num_needed = -(-num_slots // self.block_size) - len(held) - len(computed)
        num_revived = sum(1 for b in computed if self.ref_cnt[b] == 0)
        if num_needed > len(self.free_queue) - num_revived:
            return False
        for b in computed:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        blocks = held + computed + [self._pop_free() for _ in range(max(num_needed, 0))]
        self.req_blocks[rid] = blocks
        if rid not in self.num_cached_blocks:
            self.num_cached_blocks[rid] = len(computed)
        if self.enable_prefix_caching and cache:
            self._cache_full_blocks(req, num_total)
        return True

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Hash (and publish) req's full blocks up to num_tokens, whose K/V has arrived:
        loaded blocks become ordinary cached blocks."""
        assert len(self.req_blocks.get(req.request_id, [])) * self.block_size >= num_tokens
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, num_tokens)

    def free(self, req: Request) -> None:
        """Release req's blocks (abort, finish, preemption). Hashed blocks stay cached."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} freed twice"
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible while no request holds blocks."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    # -- internals ----------------------------------------------------------------------
    def _pop_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.record_events:
                    self.events.append(BlockRemoved(block_hashes=[h], medium="GPU"))
        self.ref_cnt[b] = 1
        return b

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the hashes of req's blocks that are full once this step's K/V is written."""
        rid, bs = req.request_id, self.block_size
        start, end = self.num_cached_blocks[rid], num_tokens // bs
        if end <= start:
            return
        extend_block_hashes(req.block_hashes, req.token_ids, bs, req.extra_keys)
        blocks = self.req_blocks[rid]
        run: list[int] = []  # consecutive newly stored block indices -> one BlockStored
        for i in range(start, end):
            h, b = req.block_hashes[i], blocks[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
                if run and run[-1] != i - 1:
                    self._emit_stored(req, run)
                    run = []
                run.append(i)
        if run:
            self._emit_stored(req, run)
        self.num_cached_blocks[rid] = end

    def _emit_stored(self, req: Request, run: list[int]) -> None:
        if not self.record_events:
            return
        bs, first = self.block_size, run[0]
        self.events.append(BlockStored(
            block_hashes=[req.block_hashes[i] for i in run],
            parent_block_hash=req.block_hashes[first - 1] if first else None,
            token_ids=req.token_ids[first * bs:(run[-1] + 1) * bs],
            block_size=bs, lora_id=req.lora.lora_id if req.lora else None, medium="GPU",
            lora_name=req.lora.name if req.lora else None,
        ))

    def check_invariants(self) -> None:
        """Assert the ownership rules in the module docstring (tests; O(num_blocks))."""
        refs = [0] * self.num_blocks
        for blocks in self.req_blocks.values():
            assert len(set(blocks)) == len(blocks), "a block appears twice in one table"
            for b in blocks:
                refs[b] += 1
        assert refs == self.ref_cnt, "ref counts differ from block-table membership"
        assert set(self.free_queue) == {b for b in range(self.num_blocks) if refs[b] == 0}
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
