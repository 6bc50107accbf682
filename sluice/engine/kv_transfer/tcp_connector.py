"""The connector over the TCP transport: producer holds, consumer loads (connector.py).

Producer (kv_producer / kv_both): a request with do_remote_decode that finishes (not
aborted) keeps its blocks: `_holds[request_id]` until the one pull for it has been
answered (BlockServer's thread calls `_begin` / `_end`), or `hold_timeout_s` passed
without one. The core thread frees them in `release_finished_holds`.
Consumer (kv_consumer / kv_both): a request with do_remote_prefill pulls the prompt's
blocks beyond its local prefix hits, up to the last prompt token (which is computed here
again: its logits give the first token, as vLLM does), then runs as if it had computed
them. A failed pull (prefill engine gone, timeout, refusal, layout mismatch) leaves the
request with its local hits: it prefills the rest itself, and the fallback is counted.

Tensor parallelism (`sharded`, distributed/kv_shards.py): each rank's cache holds its
share of the heads, and the wire carries them all. A hold gathers its blocks whole-headed
on rank 0 when it is made, and the server sends from that copy; a pulled reply is staged,
and scattered over the ranks on the core thread when the load is taken. Either side's
tensor-parallel size may differ from the other's.

Threads: `_holds` is shared with the BlockServer thread and guarded by `_lock`;
everything else is the core thread's.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluice.engine.kv_transfer.config import KVTransferConfig
from sluice.engine.kv_transfer.metrics import KVTransferMetrics
from sluice.engine.kv_transfer.params import KVTransferParams
from sluice.engine.kv_transfer.tcp_transport import BlockPuller, BlockServer, Layout, PullJob
from sluice.engine.request import Request

if TYPE_CHECKING:
    from sluice.engine.distributed.kv_shards import ShardedKVBlocks

log = logging.getLogger("sluice.engine.kv_transfer")
_IDLE_WAIT_S = 0.005  # an idle scheduler waits this long for a load to end


@dataclass
class _Hold:
    req: Request
    block_ids: frozenset[int]  # the ones a pull may read (the prompt's)
    num_blocks: int  # all the request's blocks, freed with the hold
    deadline: float
    state: str = "held"  # held -> sending -> pulled; or refused; or expired
    gathered: torch.Tensor | None = None  # (TP) the prompt's blocks whole-headed, in order
    order: tuple[int, ...] = ()  # (TP) their block ids


def advertised_host(cfg: KVTransferConfig) -> str:
    if cfg.advertise_host:
        return cfg.advertise_host
    if cfg.kv_ip in ("0.0.0.0", "::", "*"):
        return socket.gethostbyname(socket.gethostname())
    return cfg.kv_ip


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class TcpConnector:
    def __init__(self, config: KVTransferConfig, kv, kv_caches, registry, model_name: str,
                 sharded: ShardedKVBlocks | None = None):
        self.config, self.kv, self.sharded = config, kv, sharded
        self.metrics = KVTransferMetrics(registry, model_name)
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._sent: list[tuple[int, float]] = []  # (bytes, seconds), guarded by _lock
        self._loading: dict[str, Request] = {}
        self._cancelled: set[str] = set()
        self._ready: list[Request] = []
        self._consumed: set[str] = set()  # consumer requests whose pull was decided
        self._output_params: dict[str, dict] = {}
        self._pull_dst: dict[str, list[int]] = {}  # (TP) a loading request's blocks here
        self.server = self.puller = None
        layout = None if sharded is None else Layout.of(kv_caches, sharded.num_kv_heads)
        if config.is_producer:
            self.server = BlockServer(kv_caches, config.engine_id, config.kv_ip,
                                      config.kv_port, self._begin, self._end,
                                      config.curve_dir, layout,
                                      None if sharded is None else self._read_gathered)
            self.host = advertised_host(config)
        if config.is_consumer:
            self.puller = BlockPuller(kv_caches, config.pull_timeout_s, config.curve_dir,
                                      layout, stage=sharded is not None)

    # -- consumer: loads ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        p = req.params.kv_transfer_params
        rid = req.request_id
        if p is None or not p.do_remote_prefill or self.puller is None or rid in self._consumed:
            return 0, False
        n = req.num_prompt_tokens
        bs = self.kv.block_size
        assert p.remote_block_ids is not None and p.remote_host and p.remote_port
        if len(p.remote_block_ids) != blocks_needed(n, bs):  # the server refuses this (400)
            self._consumed.add(rid)
            self._release(req, p)
            self.metrics.fallback("transfer_failed")
            return 0, False
        need = n - 1 - num_computed_tokens  # the last prompt token is computed here
        if need <= 0:  # every block is a local hit: only free the producer's hold
            self._consumed.add(rid)
            self._release(req, p)
            return 0, False
        return need, True

    def update_state_after_alloc(self, req: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        p = req.params.kv_transfer_params
        assert p is not None and p.remote_block_ids is not None
        bs = self.kv.block_size
        first = req.num_computed_tokens // bs
        last = blocks_needed(req.num_computed_tokens + num_external_tokens, bs)
        assert req.num_computed_tokens % bs == 0 and len(block_ids) == last
        self._consumed.add(req.request_id)  # one pull per request, even if preempted later
        self._loading[req.request_id] = req
        self._pull_dst[req.request_id] = list(block_ids[first:last])
        self.puller.submit(PullJob(req.request_id, p.remote_host, p.remote_port,
                                   p.remote_engine_id, p.remote_request_id,
                                   list(p.remote_block_ids[first:last]),
                                   list(block_ids[first:last])))

    def get_finished_loading(self, room: int, idle: bool) -> list[Request]:
        if self.puller is not None:
            wait = idle and bool(self._loading) and not self._ready
            while True:
                try:
                    result = (self.puller.results.get(timeout=_IDLE_WAIT_S) if wait
                              else self.puller.results.get_nowait())
                except queue.Empty:
                    break
                wait = False
                self._loaded(result)
        room = max(room, 0)
        taken, self._ready = self._ready[:room], self._ready[room:]
        return taken

    def _loaded(self, result) -> None:
        req = self._loading.pop(result.request_id, None)
        dst = self._pull_dst.pop(result.request_id, None)
        if req is None:  # a release job: nothing was loading
            return
        if result.request_id in self._cancelled:  # aborted while loading: free now
            self._cancelled.discard(result.request_id)
            self.kv.free(req)
            return
        if result.error is None:
            if result.staged is not None:
                self.sharded.scatter(dst, result.staged)
            req.num_computed_tokens = req.num_prompt_tokens - 1
            self.kv.cache_blocks(req, req.num_computed_tokens)
            self.metrics.transferred("received", result.num_bytes, result.seconds)
        else:
            log.warning("request %s prefills locally: %s", req.request_id, result.error)
            self.metrics.fallback("transfer_failed")
        self._ready.append(req)

    def has_pending_loads(self) -> bool:
        return bool(self._loading or self._ready)

    def _release(self, req: Request, p: KVTransferParams) -> None:
        """Tell the producer its hold is no longer needed (a pull of no blocks)."""
        self.puller.submit(PullJob(f"release:{req.request_id}", p.remote_host, p.remote_port,
                                   p.remote_engine_id, p.remote_request_id, [], []))

    # -- the end of a request -------------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]:
        rid = req.request_id
        self._consumed.discard(rid)
        if rid in self._loading:  # the puller still writes its blocks
            self._cancelled.add(rid)
            return True, None
        if req in self._ready:
            self._ready.remove(req)
        p = req.params.kv_transfer_params
        # An abort reaches here before the request is marked finished: only a request
        # that finished its prefill (stop or length) holds its blocks.
        if (p is None or not p.do_remote_decode or self.server is None
                or not req.is_finished or req.finish_reason == "abort"):
            return False, None
        needed = blocks_needed(req.num_prompt_tokens, self.kv.block_size)
        assert len(block_ids) >= needed and req.num_computed_tokens >= req.num_prompt_tokens
        prompt_blocks = block_ids[:needed]
        gathered = None if self.sharded is None else self.sharded.gather(prompt_blocks)
        with self._lock:
            assert rid not in self._holds, f"request {rid} held twice"
            self._holds[rid] = _Hold(req, frozenset(prompt_blocks), len(block_ids),
                                     time.monotonic() + self.config.hold_timeout_s,
                                     gathered=gathered, order=tuple(prompt_blocks))
        self.metrics.held.inc(len(block_ids))
        params = KVTransferParams(do_remote_prefill=True, remote_engine_id=self.config.engine_id,
                                  remote_block_ids=tuple(block_ids[:needed]),
                                  remote_host=self.host,
                                  remote_port=self.server.port, remote_request_id=rid,
                                  lora_name=req.lora.name if req.lora else None)
        self._output_params[rid] = params.to_json()
        return True, self._output_params[rid]

    def pop_output_params(self, request_id: str) -> dict | None:
        return self._output_params.pop(request_id, None)

    # -- producer: holds ------------------------------------------------------------------------
    def _begin(self, request_id: str, block_ids: list[int]) -> str | None:
        """BlockServer thread: pin the hold for reading, or say why not."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.state != "held":
                return (f"request {request_id!r} holds no blocks here (pulled already, "
                        f"expired, or never prefilled here)")
            if not set(block_ids) <= hold.block_ids:
                hold.state = "refused"
                return f"blocks {sorted(set(block_ids) - hold.block_ids)} are not held"
            hold.state = "sending"
            return None

    @torch.inference_mode()
    def _read_gathered(self, request_id: str, block_ids: list[int]) -> list:
        """BlockServer thread (TP), for blocks `_begin` pinned: each layer's frame from
        the hold's whole-headed copy."""
        with self._lock:
            hold = self._holds[request_id]
        where = {b: i for i, b in enumerate(hold.order)}
        idx = torch.tensor([where[b] for b in block_ids], dtype=torch.long)
        picked = hold.gathered.index_select(2, idx.to(hold.gathered.device))
        return [layer.contiguous().view(torch.uint8).cpu().numpy() for layer in picked]

    def _end(self, request_id: str, num_bytes: int, seconds: float) -> None:
        """BlockServer thread: the reply is sent; the core thread frees the blocks."""
        with self._lock:
            self._holds[request_id].state = "pulled"
            if num_bytes:
                self._sent.append((num_bytes, seconds))

    def release_finished_holds(self) -> bool:
        now = time.monotonic()
        with self._lock:
            done = [rid for rid, h in self._holds.items()
                    if h.state in ("pulled", "refused") or (h.state == "held" and now > h.deadline)]
            ended = [(self._holds.pop(rid)) for rid in done]
            sent, self._sent = self._sent, []
        for hold in ended:
            outcome = "expired" if hold.state == "held" else hold.state
            if outcome == "expired":
                log.warning("request %s: no pull within %gs; its %d blocks are freed",
                            hold.req.request_id, self.config.hold_timeout_s,
                            hold.num_blocks)
            self.metrics.hold_ended(outcome)
            self.metrics.held.dec(hold.num_blocks)
            self.kv.free(hold.req)
        for num_bytes, seconds in sent:
            self.metrics.transferred("sent", num_bytes, seconds)
        return bool(ended or sent)

    def holds_blocks(self) -> bool:
        with self._lock:
            return bool(self._holds)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.puller is not None:
            self.puller.close()
