"""The TCP transport: a producer serves held KV blocks, a consumer pulls them (pyzmq).

Wire (one request, one reply, msgspec msgpack headers):
    consumer DEALER -> producer ROUTER:  [PullRequest]
    producer ROUTER -> consumer DEALER:  [PullReply, layer 0 bytes, ..., layer L-1 bytes]
Layer i's frame is `kv_caches[i][:, block_ids]` as raw bytes: [2, n, kv_heads, block_size,
head_dim] in the cache's dtype, so the consumer writes exactly the producer's bytes. A
PullRequest with no block ids is a release: the consumer holds every block already.
Every PullRequest, answered or refused, ends the producer's hold on that request: one
pull per request, as vLLM's NixlConnector frees after its one read notification.

A reply's layout (layers, kv heads, block size, head dim, dtype) and engine id must match
the consumer's own and the params' remote_engine_id, else the pull fails (and the
consumer prefills locally). With a CURVE folder both sockets authenticate and encrypt;
every engine of a disaggregated pool holds the same folder (`python -m sluice.zmq_curve
init DIR`), separate from the KV-event keys.

The GPU plug-in (NIXL/UCX) replaces this module only: the connector hands it block ids
and gets back (bytes, seconds) or an error (docs/engine.md).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from sluice.engine.attention.kv_quant import storage

log = logging.getLogger("sluice.engine.kv_transfer")


class Layout(msgspec.Struct, frozen=True, array_like=True):
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], num_kv_heads: int | None = None) -> Layout:
        """The caches' layout; `num_kv_heads`: the model's, where the caches hold a
        tensor-parallel rank's share (the wire carries every head)."""
        _, _, heads, block_size, head_dim = kv_caches[0].shape
        return cls(len(kv_caches), num_kv_heads or heads, block_size, head_dim,
                   str(kv_caches[0].dtype))

    def block_bytes(self, itemsize: int) -> int:
        """Bytes of one block in one layer (keys and values)."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * itemsize


class PullRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str  # the producer's, from remote_request_id
    block_ids: list[int]  # the producer's block ids to send (empty: release only)
    engine_id: str  # the producer the consumer means to reach


class PullReply(msgspec.Struct, frozen=True, array_like=True):
    engine_id: str
    layout: Layout
    error: str | None = None


_enc = msgspec.msgpack.Encoder()
_pull_dec = msgspec.msgpack.Decoder(PullRequest)
_reply_dec = msgspec.msgpack.Decoder(PullReply)


def _security(curve_dir: str | None):
    if curve_dir is None:
        return None
    from sluice.zmq_curve import ZmqSecurity

    return ZmqSecurity(curve_dir)


class BlockServer:
    """Producer side: answers PullRequests from a ROUTER socket on its own thread.

    `begin(request_id, block_ids)` (the connector's, thread-safe) returns None when the
    blocks may be read now (the hold is then pinned until `end`), else the refusal's text.
    `end(request_id)` releases the hold. The thread owns the socket; it reads kv_caches
    only for blocks `begin` pinned, which the core thread neither frees nor writes; or,
    given `read(request_id, block_ids) -> frames`, the frames that returns (a
    tensor-parallel engine's blocks, gathered whole-headed when they were held).
    """

    def __init__(self, kv_caches: list[torch.Tensor], engine_id: str, bind_host: str,
                 port: int, begin: Callable[[str, list[int]], str | None],
                 end: Callable[[str, int, float], None], curve_dir: str | None = None,
                 layout: Layout | None = None,
                 read: Callable[[str, list[int]], list] | None = None):
        self.kv_caches, self.engine_id = kv_caches, engine_id
        self.layout = layout or Layout.of(kv_caches)
        self._begin, self._end = begin, end
        self._read_held = read
        self._ctx = zmq.Context()
        security = _security(curve_dir)
        self._auth = security.authenticator(self._ctx) if security else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if security:
            security.as_server(self._sock)
        if port == 0:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        else:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-block-server",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            try:
                self._answer(frames)
            except Exception:  # a bad peer must not stop the server: log, serve the next
                log.exception("KV block server: a pull failed")

    def _answer(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if len(frames) != 2:
            self._reply(ident, f"malformed pull request: {len(frames) - 1} frames, not 1")
            return
        try:
            req = _pull_dec.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._reply(ident, f"malformed pull request: {exc}")
            return
        if req.engine_id != self.engine_id:
            self._reply(ident, f"this is engine {self.engine_id!r}, not {req.engine_id!r}")
            return
        refused = self._begin(req.request_id, req.block_ids)
        if refused is not None:
            self._reply(ident, refused)
            return
        start, sent = time.monotonic(), 0
        try:
            frames = (self._read(req.block_ids) if self._read_held is None or not req.block_ids
                      else self._read_held(req.request_id, req.block_ids))
            sent = sum(f.nbytes for f in frames)
            self._reply(ident, None, frames)
        finally:
            self._end(req.request_id, sent, time.monotonic() - start)

    @torch.inference_mode()
    def _read(self, block_ids: list[int]) -> list:
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        return [c.index_select(1, idx).contiguous().view(torch.uint8).cpu().numpy()
                for c in self.kv_caches]

    def _reply(self, ident: bytes, error: str | None, frames: list | None = None) -> None:
        head = _enc.encode(PullReply(self.engine_id, self.layout, error))
        self._sock.send_multipart([ident, head, *(frames or [])], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


@dataclass(frozen=True)
class PullJob:
    request_id: str  # the consumer's request
    host: str
    port: int
    engine_id: str
    remote_request_id: str
    src_block_ids: list[int]  # the producer's blocks
    dst_block_ids: list[int]  # where they go here (same length)


@dataclass(frozen=True)
class PullResult:
    request_id: str
    error: str | None
    num_bytes: int = 0
    seconds: float = 0.0
    staged: torch.Tensor | None = None  # whole-headed blocks, when the puller stages


class BlockPuller:
    """Consumer side: runs PullJobs on its own thread, writing into kv_caches' dst blocks.

    The thread owns its sockets and writes only the dst blocks of the job it runs, which
    the connector keeps allocated (and unscheduled) until the job's PullResult is taken
    from `results` (a thread-safe queue: the core thread drains it). With `stage`, it
    writes nothing: the result carries the blocks (whole-headed, [layers, 2, blocks,
    heads, block size, head dim]) for the core thread to scatter over the ranks."""

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float,
                 curve_dir: str | None = None, layout: Layout | None = None,
                 stage: bool = False):
        self.kv_caches, self.timeout_s, self.stage = kv_caches, timeout_s, stage
        self.layout = layout or Layout.of(kv_caches)
        self._security = _security(curve_dir)
        self._ctx = zmq.Context()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self.results: queue.Queue[PullResult] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-block-puller", daemon=True)
        self._thread.start()

    def submit(self, job: PullJob) -> None:
        assert len(job.src_block_ids) == len(job.dst_block_ids)
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            start, staged = time.monotonic(), None
            try:
                (error, staged), nbytes = self._pull(job), 0
                if error is None:
                    nbytes = len(job.dst_block_ids) * self.layout.num_layers * (
                        self.layout.block_bytes(self.kv_caches[0].element_size()))
            except Exception as exc:  # any failure means: prefill locally
                log.exception("KV pull for %s failed", job.request_id)
                error, nbytes = f"KV pull failed: {exc!r}", 0
            self.results.put(PullResult(job.request_id, error, nbytes,
                                        time.monotonic() - start, staged))

    def _pull(self, job: PullJob) -> tuple[str | None, torch.Tensor | None]:
        """Pull one job's blocks into place (or stage them): (the failure's text, or None;
        the staged blocks)."""
        where = f"prefill engine {job.host}:{job.port}"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self._security is not None:
                self._security.as_client(sock)
            sock.connect(f"tcp://{job.host}:{job.port}")
            sock.send(_enc.encode(PullRequest(job.remote_request_id, job.src_block_ids,
                                              job.engine_id)))
            if not sock.poll(int(self.timeout_s * 1000)):
                return f"{where} did not answer within {self.timeout_s:g}s", None
            frames = sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)
        reply = _reply_dec.decode(frames[0].bytes)
        if reply.error is not None:
            return f"{where} refused the pull: {reply.error}", None
        if reply.layout != self.layout:
            return f"{where} has KV layout {reply.layout}, this engine {self.layout}", None
        return self._write(job, frames[1:])

    @torch.inference_mode()
    def _write(self, job: PullJob, frames: list) -> tuple[str | None, torch.Tensor | None]:
        n = len(job.dst_block_ids)
        if not n:
            return None, None
        lay = self.layout
        expected = n * lay.block_bytes(self.kv_caches[0].element_size())
        if len(frames) != lay.num_layers or any(len(f.buffer) != expected for f in frames):
            return (f"malformed pull reply: expected {lay.num_layers} frames of {expected} "
                    "bytes"), None
        dtype = self.kv_caches[0].dtype
        shape = (2, n, lay.num_kv_heads, lay.block_size, lay.head_dim)
        blocks = [torch.frombuffer(bytearray(f.buffer), dtype=torch.uint8).view(dtype)
                  .view(shape) for f in frames]
        if self.stage:
            return None, torch.stack(blocks)
        idx = torch.tensor(job.dst_block_ids, dtype=torch.long,
                           device=self.kv_caches[0].device)
        for cache, data in zip(self.kv_caches, blocks):
            storage(cache).index_copy_(1, idx, storage(data.to(cache.device)))
        return None, None

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._ctx.term()
