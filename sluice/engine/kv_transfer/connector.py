"""The KV connector: the plug point between the engine and a KV transport (vLLM's names).

The scheduler and engine call these hooks, all on the core thread:
- `get_num_new_matched_tokens(req, num_computed_tokens)` at admission: how many of
  req's tokens beyond its local prefix hits a remote engine holds, and whether they load
  asynchronously (always, here). 0: admit as usual.
- `update_state_after_alloc(req, block_ids, num_external_tokens)`: the scheduler has
  allocated req's blocks (hits + the blocks to load, left unhashed until loaded); the
  connector starts the load. req then waits, holding its blocks, in neither queue.
- `get_finished_loading(room, idle)`: up to `room` loading requests whose load ended,
  their num_computed_tokens set (a failed load leaves the local hits only: the request
  prefills the rest itself) and loaded blocks hashed like computed ones. `idle`: the
  scheduler has nothing else to run, so the call may wait a few ms for a load.
- `has_pending_loads()`: requests are loading or loaded and not yet admitted.
- `request_finished(req, block_ids) -> (delay_free, kv_transfer_params)`: the request
  ended (finish or abort). delay_free: the connector frees the blocks itself later
  (held for a remote pull, or still being written by a load); the params go back to the
  client in the response.
- `release_finished_holds()`: called every turn of the core loop, busy or idle: frees
  holds that were pulled or timed out; True when anything changed.
- `holds_blocks()`: whether the core loop must keep turning (at least every 50 ms) to
  release holds; `close()`.
Invariant: a block the connector holds or loads into is in exactly one request's block
table (kv_cache_manager's ownership rules hold throughout).
"""

from __future__ import annotations

from typing import Protocol

from sluice.engine.kv_transfer.config import KVTransferConfig
from sluice.engine.request import Request


class KVConnector(Protocol):
    config: KVTransferConfig

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]: ...

    def update_state_after_alloc(self, req: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None: ...

    def get_finished_loading(self, room: int, idle: bool) -> list[Request]: ...

    def has_pending_loads(self) -> bool: ...

    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]: ...

    def release_finished_holds(self) -> bool: ...

    def holds_blocks(self) -> bool: ...

    def close(self) -> None: ...


def make_connector(config: KVTransferConfig, kv, kv_caches, registry, model_name: str,
                   sharded=None) -> KVConnector:
    """The connector `config.kv_connector` names (config.py lists them); `sharded`: a
    tensor-parallel engine's whole-headed view of its ranks' caches
    (distributed/kv_shards.py), None on one rank."""
    from sluice.engine.kv_transfer.tcp_connector import TcpConnector

    return TcpConnector(config, kv, kv_caches, registry, model_name, sharded)
