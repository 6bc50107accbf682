"""KV-event wire format and publisher, checked against vLLM's structure byte for byte."""

import time

import msgspec
import pytest
import zmq

from sluice.engine.kv_publisher import KVEventPublisher
from sluice.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

# vLLM vllm/distributed/kv_events.py (after PR #42892): field names and order.
VLLM_BLOCK_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                     "kv_cache_spec_sliding_window")
VLLM_BLOCK_REMOVED = ("block_hashes", "medium", "group_idx")


def _stored(**kw):
    base = {"block_hashes": [2**63 + 5, -7], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
            "lora_name": None}
    base.update(kw)
    return BlockStored(**base)


def test_struct_fields_match_vllm():
    assert BlockStored.__struct_fields__ == VLLM_BLOCK_STORED
    assert BlockRemoved.__struct_fields__ == VLLM_BLOCK_REMOVED
    assert AllBlocksCleared.__struct_fields__ == ()
    assert KVEventBatch.__struct_fields__ == ("ts", "events", "data_parallel_rank")
    with pytest.raises(TypeError):  # lora_name has no default in vLLM either
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1,
                    lora_id=None, medium="GPU")


def test_payload_bytes_equal_hand_built_vllm_map_encoding():
    batch = KVEventBatch(ts=1700000000.25, data_parallel_rank=0, events=[
        _stored(parent_block_hash=b"\x01" * 32, extra_keys=[None, ("salt",)]),
        BlockRemoved(block_hashes=[3], medium="GPU"),
        AllBlocksCleared()])
    expected = msgspec.msgpack.encode({
        "ts": 1700000000.25,
        "events": [
            {"type": "BlockStored", "block_hashes": [2**63 + 5, -7],
             "parent_block_hash": b"\x01" * 32, "token_ids": [1, 2, 3, 4], "block_size": 2,
             "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None, ["salt"]]},
            {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
            {"type": "AllBlocksCleared"}],
        "data_parallel_rank": 0})
    assert encode_batch(batch) == expected
    assert decode_batch(expected) == batch


def test_decode_legacy_positional_and_mixed_encodings():
    legacy = msgspec.msgpack.encode([
        1.0, [["BlockStored", [10, 11], None, [1, 2, 3, 4], 2, None, "GPU"],
              ["BlockRemoved", [10]], ["AllBlocksCleared"], ["FutureEvent", 1]], 0])
    b = decode_batch(legacy)
    assert b.ts == 1.0 and b.data_parallel_rank == 0 and len(b.events) == 3
    assert b.events[0].block_hashes == [10, 11] and b.events[0].token_ids == [1, 2, 3, 4]
    assert b.events[1] == BlockRemoved(block_hashes=[10], medium=None)
    mixed = msgspec.msgpack.encode([2.0, [{"type": "BlockRemoved", "block_hashes": [b"\xff"],
                                           "medium": "GPU", "new_field": 1}]])
    assert decode_batch(mixed).events == [BlockRemoved(block_hashes=[b"\xff"], medium="GPU")]
    with pytest.raises((TypeError, ValueError, msgspec.DecodeError)):
        decode_batch(msgspec.msgpack.encode("nope"))


@pytest.fixture
def publisher():
    pub = KVEventPublisher("tcp://*:0", "tcp://*:0",
                           topic="kv@h:1@m", buffer_steps=5)
    yield pub
    pub.close()


def _connect(kind, endpoint):
    s = zmq.Context.instance().socket(kind)
    s.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
    return s


def test_publisher_multipart_seq_and_replay(publisher):
    sub = _connect(zmq.SUB, publisher.last_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    time.sleep(0.3)  # slow-joiner
    publisher.publish([])  # no batch, no seq
    for i in range(7):
        publisher.publish([_stored(block_hashes=[i])])
    got = []
    for _ in range(7):
        assert sub.poll(3000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@h:1@m" and len(seq) == 8
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        assert batch.data_parallel_rank == 0
        got.append((int.from_bytes(seq, "big"), batch.events[0].block_hashes[0]))
    assert got == [(i, i) for i in range(7)]

    dealer = _connect(zmq.DEALER, publisher.last_replay_endpoint)

    def replay(start):
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(3000)
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seqs.append(int.from_bytes(seq, "big", signed=True))
            if seq == END_SEQ:
                assert payload == b""
                return seqs
            assert decode_batch(payload).events[0].block_hashes == [seqs[-1]]

    assert replay(4) == [4, 5, 6, -1]
    # Buffer keeps the last 5 batches (seq 2..6) for a replay from 0.
    assert replay(0) == [2, 3, 4, 5, 6, -1]
    for s in (sub, dealer):
        s.close(linger=0)


def test_publish_after_close_raises(publisher):
    publisher.close()
    with pytest.raises(RuntimeError):
        publisher.publish([AllBlocksCleared()])
