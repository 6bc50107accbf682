"""KV transfer between engines, in one process: the config, the params, the TCP
transport over real loopback sockets (bytes, CURVE, refusals, timeouts) and the
connector inside two real LLMEngines (greedy equality, hashing, holds, faults)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
import zmq
from polling import wait_for

from sluice.engine.block_hash import extend_block_hashes
from sluice.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.kv_transfer.config import KVTransferConfig
from sluice.engine.kv_transfer.params import KVTransferParams
from sluice.engine.kv_transfer.tcp_transport import BlockPuller, BlockServer, PullJob
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams
from sluice.kv_events import BlockStored
from sluice.zmq_curve import init

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# -- config and params -----------------------------------------------------------------------
def test_config_takes_vllms_json():
    cfg = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "SluiceConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda",
        "kv_port": 0, "engine_id": None,
        "kv_connector_extra_config": {"hold_timeout_s": 5, "advertise_host": "10.0.0.1"}}))
    assert cfg.is_producer and cfg.is_consumer and cfg.engine_id and cfg.hold_timeout_s == 5
    consumer = KVTransferConfig.from_json('{"kv_connector": "TcpConnector", "kv_role": '
                                          '"kv_consumer"}')
    assert consumer.is_consumer and not consumer.is_producer


@pytest.mark.parametrize(("text", "message"), [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "planned"),
    ('{"kv_connector": "SluiceConnector", "kv_role": "kv_sender"}', "kv_role"),
    ('{"kv_connector": "SluiceConnector", "kv_role": "kv_both", "kv_prt": 1}', "kv_prt"),
    (json.dumps({"kv_connector": "SluiceConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"timeout": 1}}), "timeout"),
    ('{"kv_role": "kv_both"}', "kv_connector"),
    ('[1]', "JSON object"),
    ('{', "not JSON"),
])
def test_config_errors_name_the_problem(text, message):
    with pytest.raises((ValueError, TypeError), match=message):
        KVTransferConfig.from_json(text)


@pytest.mark.parametrize(("fields", "message"), [
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
    ({"do_remote_prefill": True}, "remote_engine_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h",
      "remote_request_id": "r", "remote_port": 0, "remote_block_ids": (1,)}, "remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "h",
      "remote_request_id": "r", "remote_port": 9, "remote_block_ids": ()}, "remote_block_ids"),
    ({"tp_size": 2}, "tp_size"),
])
def test_params_refuse_incomplete_or_contradictory_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        KVTransferParams(**fields)


# -- the transport ---------------------------------------------------------------------------
def _caches(dtype, num_blocks=12, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, num_blocks, 2, 4, 8), generator=g).to(dtype) for _ in range(layers)]


class _Holds:
    """begin/end for a BlockServer: request 'r' holds blocks 1..6, for one pull."""

    def __init__(self):
        self.held, self.ended = {"r": {1, 2, 3, 4, 5, 6}}, []

    def begin(self, rid, ids):
        if rid not in self.held or not set(ids) <= self.held[rid]:
            return f"no hold for {rid}"
        del self.held[rid]
        return None

    def end(self, rid, num_bytes, seconds):
        self.ended.append((rid, num_bytes))


def _pull(puller, port, src, dst, rid="r", engine="p"):
    puller.submit(PullJob("local", "127.0.0.1", port, engine, rid, src, dst))
    return puller.results.get(timeout=30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("curve", [False, True])
def test_pulled_blocks_are_byte_identical(dtype, curve, tmp_path):
    keys = None
    if curve:
        keys = str(tmp_path / "keys")
        init(keys)
    src, dst = _caches(dtype), _caches(dtype, seed=1)
    before = [c.clone() for c in dst]
    holds = _Holds()
    server = BlockServer(src, "p", "127.0.0.1", 0, holds.begin, holds.end, keys)
    puller = BlockPuller(dst, 10.0, keys)
    try:
        result = _pull(puller, server.port, [5, 2, 3], [0, 9, 4])
        assert result.error is None and result.num_bytes == 3 * 3 * 2 * 2 * 4 * 8 * dtype.itemsize
        for s, d, b in zip(src, dst, before):
            for si, di in zip([5, 2, 3], [0, 9, 4]):
                assert torch.equal(s[:, si].view(torch.uint8), d[:, di].view(torch.uint8))
            untouched = [i for i in range(12) if i not in (0, 9, 4)]
            assert torch.equal(d[:, untouched], b[:, untouched])  # nothing else written
        assert holds.ended == [("r", result.num_bytes)]
        again = _pull(puller, server.port, [1], [1])  # one pull per hold
        assert again.error and "no hold" in again.error
    finally:
        puller.close()
        server.close()


def test_a_client_without_the_curve_key_gets_nothing(tmp_path):
    init(str(tmp_path / "keys"))
    init(str(tmp_path / "rogue"))
    holds = _Holds()
    server = BlockServer(_caches(torch.float32), "p", "127.0.0.1", 0, holds.begin, holds.end,
                         str(tmp_path / "keys"))
    puller = BlockPuller(_caches(torch.float32), 1.0, str(tmp_path / "rogue"))
    try:
        result = _pull(puller, server.port, [1], [1])
        assert "did not answer" in result.error and "r" in holds.held
    finally:
        puller.close()
        server.close()


def test_each_role_needs_only_its_half_of_the_keys(tmp_path):
    """As the operator mounts them (sluice.operator.render.KV_TRANSFER_CURVE_FILES): the
    prefill engine's server pair and the client's public key, the decode engine's reverse."""
    import shutil

    from sluice.operator.render import KV_TRANSFER_CURVE_FILES

    init(str(tmp_path / "keys"))
    halves = {}
    for role, files in KV_TRANSFER_CURVE_FILES.items():
        halves[role] = tmp_path / role
        halves[role].mkdir()
        for name in files:
            shutil.copy(tmp_path / "keys" / name, halves[role] / name)
    holds = _Holds()
    server = BlockServer(_caches(torch.float32), "p", "127.0.0.1", 0, holds.begin, holds.end,
                         str(halves["prefill"]))
    puller = BlockPuller(_caches(torch.float32, seed=1), 10.0, str(halves["decode"]))
    try:
        assert _pull(puller, server.port, [1, 2], [3, 4]).error is None
    finally:
        puller.close()
        server.close()


def test_layout_and_engine_mismatches_fail_the_pull():
    holds = _Holds()
    server = BlockServer(_caches(torch.float32), "p", "127.0.0.1", 0, holds.begin, holds.end)
    puller = BlockPuller(_caches(torch.bfloat16), 10.0)
    try:
        assert "not 'q'" in _pull(puller, server.port, [1], [1], engine="q").error
        assert "layout" in _pull(puller, server.port, [1], [1]).error
    finally:
        puller.close()
        server.close()


def test_a_silent_producer_times_out():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    puller = BlockPuller(_caches(torch.float32), 0.5)
    try:
        start = time.monotonic()
        assert "did not answer within 0.5s" in _pull(puller, port, [1], [1]).error
        assert time.monotonic() - start < 5
    finally:
        puller.close()
        silent.close(linger=0)
        ctx.term()


# -- the connector inside two engines ----------------------------------------------------------
def _engine(role, **kw):
    return LLMEngine(EngineConfig(
        model="tiny-llama", served_model_name="t", load_format="dummy", dtype="float32",
        cache=CacheConfig(num_blocks=64, block_size=4),
        scheduler=SchedulerConfig(max_model_len=200, max_num_batched_tokens=16),
        kv_transfer=KVTransferConfig("SluiceConnector", role, kv_port=0, **kw)),
        record_kv_events=True)


@pytest.fixture
def engines():
    p = _engine("kv_producer", engine_id="p", hold_timeout_s=1.0)
    d = _engine("kv_consumer", pull_timeout_s=2.0)
    yield p, d
    for e in (p, d):
        if e.kv_connector is not None:
            e.kv_connector.close()


def _run(engine, rid, prompt, params, salt=None, other=None):
    engine.add_request(rid, prompt, params, salt)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
        if other is not None:
            other.kv_connector.release_finished_holds()
    return outs


def _prefill(p, rid, prompt, salt=None):
    outs = _run(p, rid, prompt, dataclasses.replace(
        GREEDY, max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True)), salt)
    params = outs[-1].kv_transfer_params
    assert params is not None and params["remote_request_id"] == rid
    return KVTransferParams(**{**params, "remote_block_ids": tuple(params["remote_block_ids"])})


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_decode_pulls_then_matches_plain_greedy(engines):
    p, d = engines
    prompt = list(range(3, 45))  # 42 tokens: three 16-token chunks on the producer
    ref = _tokens(_run(d, "ref", prompt, GREEDY, salt="ref"))
    params = _prefill(p, "a", prompt)
    assert p.kv_connector.holds_blocks() and len(params.remote_block_ids) == 11
    d.kv.take_events()
    outs = _run(d, "b", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params),
                other=p)
    assert _tokens(outs) == ref
    hashes: list[int] = []
    extend_block_hashes(hashes, prompt, 4, ())
    for h in hashes:  # the pulled blocks hold the producer's bytes
        src, dst = p.kv.cached[h], d.kv.cached[h]
        for pc, dc in zip(p.runner.kv_caches, d.runner.kv_caches):
            assert torch.equal(pc[:, src].view(torch.uint8), dc[:, dst].view(torch.uint8))
    # The pulled blocks are ordinary cached blocks: hashed, published, reusable.
    stored = [e for e in d.kv.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) >= 41 // 4
    again = _run(d, "c", prompt, GREEDY)
    assert again[0].num_cached_tokens == 40 and _tokens(again) == ref
    wait_for(lambda: p.kv_connector.release_finished_holds() or
             not p.kv_connector.holds_blocks(), what="the producer frees the pulled blocks")
    assert p.kv.num_free_blocks == p.kv.num_blocks
    for e in (p, d):
        e.kv.check_invariants()
    assert d.kv.num_free_blocks == d.kv.num_blocks


def test_only_blocks_the_consumer_lacks_are_pulled(engines):
    p, d = engines
    shared = list(range(10, 34))  # 24 tokens = 6 blocks the consumer computes itself
    _run(d, "warm", shared + [7, 7], GREEDY)
    prompt = shared + list(range(50, 70))
    params = _prefill(p, "a", prompt)
    outs = _run(d, "b", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params), other=p)
    assert outs[0].num_cached_tokens == 24
    received = d.kv_connector.metrics.bytes.labels("t", "received")._value.get()
    per_block = d.runner.kv_caches[0][:, 0].numel() * 4 * len(d.runner.kv_caches)
    assert received == (-(-(len(prompt) - 1) // 4) - 6) * per_block
    assert _tokens(outs) == _tokens(_run(d, "ref", prompt, GREEDY, salt="ref"))


def test_a_dead_producer_means_a_local_prefill(engines):
    p, d = engines
    prompt = list(range(5, 30))
    params = _prefill(p, "a", prompt)
    p.kv_connector.close()  # gone before the pull
    p.kv_connector = None
    outs = _run(d, "b", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params))
    assert _tokens(outs) == _tokens(_run(d, "ref", prompt, GREEDY, salt="ref"))
    assert d.kv_connector.metrics.fallbacks.labels("t", "transfer_failed")._value.get() == 1
    d.kv.check_invariants()
    assert d.kv.num_free_blocks == d.kv.num_blocks


def test_unpulled_blocks_are_freed_after_the_hold_timeout(engines):
    p, _ = engines
    _prefill(p, "a", list(range(5, 30)))
    assert p.kv_connector.metrics.held._value.get() == 7
    wait_for(lambda: p.kv_connector.release_finished_holds() or
             not p.kv_connector.holds_blocks(), timeout=5, what="the hold expires")
    assert p.kv.num_free_blocks == p.kv.num_blocks
    assert p.kv_connector.metrics.held._value.get() == 0
    assert p.kv_connector.metrics.holds.labels("t", "expired")._value.get() == 1


def test_an_abort_while_loading_frees_only_after_the_load(engines):
    p, d = engines
    prompt = list(range(5, 30))
    params = _prefill(p, "a", prompt)
    d.add_request("b", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params))
    d.step()  # admitted: loading, holding its blocks
    assert d.kv_connector.has_pending_loads() and d.kv.block_table("b")
    d.abort_request("b")
    assert d.kv.block_table("b"), "blocks the puller may still write stay allocated"
    wait_for(lambda: (d.step(), not d.has_unfinished())[1], what="the load ends")
    assert d.kv.num_free_blocks == d.kv.num_blocks
    d.kv.check_invariants()


def test_an_aborted_prefill_leg_holds_nothing(engines):
    p, _ = engines
    p.add_request("a", list(range(5, 45)), dataclasses.replace(
        GREEDY, max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    p.step()  # a 16-token chunk of 40
    p.abort_request("a")
    assert not p.kv_connector.holds_blocks() and p.kv.num_free_blocks == p.kv.num_blocks


def test_a_load_waits_for_free_blocks_then_still_pulls(engines):
    p, d = engines
    prompt = list(range(5, 30))
    params = _prefill(p, "a", prompt)
    d.add_request("big", list(range(100, 160)), GREEDY)  # 60 tokens: 15 of 64 blocks
    d.step()
    taken = [d.kv._pop_free() for _ in range(d.kv.num_free_blocks - 2)]  # starve the pool
    d.add_request("b", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params))
    d.step()
    assert not d.kv_connector.has_pending_loads() and d.scheduler.waiting  # no room yet
    for b in taken:  # give the blocks back
        d.kv.ref_cnt[b] = 0
        d.kv.free_queue[b] = None
    outs = []
    while d.has_unfinished():
        outs += [o for o in d.step() if o.request_id == "b"]
    assert d.kv_connector.metrics.bytes.labels("t", "received")._value.get() > 0
    assert _tokens(outs) == _tokens(_run(d, "ref", prompt, GREEDY, salt="ref"))
    d.kv.check_invariants()


# -- the API side ------------------------------------------------------------------------------
def _prepare(kv_role, **fields):
    import asyncio
    from types import SimpleNamespace

    from sluice.engine.server.disagg import DisaggLegs
    from sluice.engine.server.protocol import CompletionRequest

    body = CompletionRequest(prompt="hi", **fields)
    legs = DisaggLegs(kv_role, 4, "t")
    return asyncio.run(legs.prepare(SimpleNamespace(headers={}), body, [[1, 2, 3, 4, 5]], {}))


def test_an_engine_without_kv_transfer_refuses_transfers_and_ignores_empty_params():
    from sluice.engine.server.errors import RequestError

    with pytest.raises(RequestError, match="--kv-transfer-config"):
        _prepare(None, kv_transfer_params={"do_remote_decode": True})
    assert _prepare(None, kv_transfer_params={"do_remote_decode": False}) == {}
    with pytest.raises(RequestError, match="kv_consumer"):
        _prepare("kv_consumer", kv_transfer_params={"do_remote_decode": True})
    derived = _prepare("kv_producer", max_tokens=50, min_tokens=3,
                       kv_transfer_params={"do_remote_decode": True})
    assert derived["max_tokens"] == 1 and derived["min_tokens"] == 0
    assert derived["kv_transfer_params"].do_remote_decode


def test_garbage_does_not_stop_the_block_server():
    holds = _Holds()
    src = _caches(torch.float32)
    server = BlockServer(src, "p", "127.0.0.1", 0, holds.begin, holds.end)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(f"tcp://127.0.0.1:{server.port}")
    puller = BlockPuller(_caches(torch.float32, seed=2), 10.0)
    try:
        for frames in ([b"\xc1"], [b"a", b"b"], [b"\x93\x01\x02\x03"]):
            rogue.send_multipart(frames)
            assert rogue.poll(5000), "every request gets an answer"
            assert b"malformed" in rogue.recv_multipart()[0]
        assert _pull(puller, server.port, [1, 2], [3, 4]).error is None
    finally:
        puller.close()
        rogue.close(linger=0)
        ctx.term()
        server.close()
