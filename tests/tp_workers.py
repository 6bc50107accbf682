"""Test helpers (no tests here): a tensor-parallel rank, run in its own process by
torch.multiprocessing, checking the parallel layers against the unsharded computation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from sluice.engine.distributed.parallel_state import init_tensor_parallel
from sluice.engine.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_shards,
    qkv_shards,
)
from sluice.engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

HIDDEN, HEADS, HEAD_DIM, INTER, VOCAB, TOKENS = 16, 4, 4, 24, 37, 5


def check_rank(rank: int, world: int, init_file: str, kv_heads: int,
               shm_path: str | None) -> None:
    """One rank's checks; `init_file`: the group's rendezvous (file://); `shm_path`: the
    shared-memory all-reduce's segment (None: gloo's all-reduce)."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, f"file://{init_file}", torch.device("cpu"),
                              shm_path)
    assert (tp.shm is not None) == (shm_path is not None)
    try:
        _check(tp, rank, world, kv_heads, f"{init_file}.weights.safetensors")
    finally:
        tp.close()


def check_shm_all_reduce(rank: int, world: int, init_file: str, shm_path: str) -> None:
    """Rank r contributes (r + 1) x a seeded tensor: in rounds (larger than a slot), in
    bfloat16 and float32, every rank gets the same bits, the rank-ordered sum."""
    from sluice.engine.distributed.shm_all_reduce import SLOT_BYTES

    tp = init_tensor_parallel(rank, world, f"file://{init_file}", torch.device("cpu"),
                              shm_path)
    try:
        for dtype, numel in ((torch.float32, SLOT_BYTES // 4 * 2 + 123), (torch.bfloat16, 999)):
            base = torch.randn(numel, generator=torch.Generator().manual_seed(7)).to(dtype)
            got = tp.all_reduce(base * (rank + 1))
            want = base.clone()
            for r in range(1, world):
                want.add_(base * (r + 1))
            assert torch.equal(got, want), (dtype, rank)
            everyone = tp.all_gather(got.float().unsqueeze(0), dim=0)
            assert all(torch.equal(everyone[0], row) for row in everyone)
    finally:
        tp.close()


def _check(tp, rank: int, world: int, kv_heads: int, path: str) -> None:
    gen = torch.Generator().manual_seed(0)  # the same full weights on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q_w, k_w, v_w = rand(HEADS * HEAD_DIM, HIDDEN), rand(kv_heads * HEAD_DIM, HIDDEN), \
        rand(kv_heads * HEAD_DIM, HIDDEN)
    q_b, k_b, v_b = rand(HEADS * HEAD_DIM), rand(kv_heads * HEAD_DIM), rand(kv_heads * HEAD_DIM)
    o_w, o_b = rand(HIDDEN, HEADS * HEAD_DIM), rand(HIDDEN)
    gate_w, up_w, down_w = rand(INTER, HIDDEN), rand(INTER, HIDDEN), rand(HIDDEN, INTER)
    emb = rand(VOCAB, HIDDEN)
    x = rand(TOKENS, HIDDEN)
    ids = torch.tensor([0, 36, 9, 18, 27])

    # q/k/v: each rank's heads
    shards = qkv_shards(HEADS, kv_heads, HEAD_DIM, tp)
    qkv = ColumnParallelLinear(HIDDEN, shards, True, tp)
    for name, w, b in (("q_proj", q_w, q_b), ("k_proj", k_w, k_b), ("v_proj", v_w, v_b)):
        qkv.weight_loader("weight", w, name)
        qkv.weight_loader("bias", b, name)
    out = qkv(x)
    for name, w, b in (("q_proj", q_w, q_b), ("k_proj", k_w, k_b), ("v_proj", v_w, v_b)):
        s, off = shards[name], qkv.local_offsets[name]
        torch.testing.assert_close(out[:, off:off + s.size],
                                   F.linear(x, w, b)[:, s.start:s.start + s.size])
    if kv_heads < world:  # replicated: rank r holds kv head r // (world / kv_heads)
        assert shards["k_proj"].start == (rank // (world // kv_heads)) * HEAD_DIM

    # o_proj over this rank's q heads: the all-reduced sum is the full layer
    o = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, True, tp)
    o.weight_loader("weight", o_w, "o_proj")
    o.weight_loader("bias", o_b, "o_proj")
    attn = rand(TOKENS, HEADS * HEAD_DIM)
    q = shards["q_proj"]
    torch.testing.assert_close(o(attn[:, q.start:q.start + q.size]), F.linear(attn, o_w, o_b))

    # the MLP: column-parallel gate/up, then row-parallel down
    gate_up = ColumnParallelLinear(HIDDEN, column_shards(
        {"gate_proj": INTER, "up_proj": INTER}, tp), False, tp)
    gate_up.weight_loader("weight", gate_w, "gate_proj")
    gate_up.weight_loader("weight", up_w, "up_proj")
    # (read from a safetensors file as the loader will: each rank its slice only)
    if rank == 0:
        save_file({"down": down_w, "emb": emb}, path)
    torch.distributed.barrier(group=tp.group)
    down = RowParallelLinear(INTER, HIDDEN, False, tp)
    with safe_open(path, framework="pt") as f:
        down.weight_loader("weight", f.get_slice("down"), "down_proj")
    g, u = gate_up(x).chunk(2, dim=-1)
    want = F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
    torch.testing.assert_close(down(F.silu(g) * u), want)

    # the vocabulary: embedding on every rank, logits on rank 0
    embedding = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    with safe_open(path, framework="pt") as f:
        embedding.weight_loader("weight", f.get_slice("emb"), "embed_tokens")
    torch.testing.assert_close(embedding(ids), F.embedding(ids, emb))
    for tied in (True, False):
        head = ParallelLMHead(embedding, tied)
        if not tied:
            head.weight_loader("weight", emb * 2, "lm_head")
        logits = head(x)
        if rank == 0:
            torch.testing.assert_close(logits, F.linear(x, emb if tied else emb * 2))
        else:
            assert logits is None
