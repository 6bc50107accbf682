"""KV-event sockets under ZMQ CURVE: a client without the pickers' key gets nothing, not
even a replay of the stored blocks (whose token ids are other users' prompts)."""

import time

import pytest
import zmq
from polling import wait_for

from sluice.engine.kv_publisher import KVEventPublisher
from sluice.gateway.events.sockets import connect
from sluice.kv_events import BlockStored, decode_batch
from sluice.zmq_curve import ZmqSecurity, init

SECRET_PROMPT = [4242, 1337, 9001, 7]  # "my password is ..." as token ids


@pytest.fixture
def keys(tmp_path):
    init(str(tmp_path / "keys"))
    return ZmqSecurity(str(tmp_path / "keys"))


@pytest.fixture
def publisher(keys):
    pub = KVEventPublisher("tcp://*:0", "tcp://*:0", topic="kv@pod@m", security=keys)
    pub.publish([BlockStored(block_hashes=[1], parent_block_hash=None,
                             token_ids=SECRET_PROMPT, block_size=4, lora_id=None,
                             medium="CPU", lora_name=None)])
    yield pub
    pub.close()


def endpoints(pub):
    def local(e):
        return e.replace("0.0.0.0", "127.0.0.1")
    return local(pub.last_endpoint), local(pub.last_replay_endpoint)


def replay(sock, timeout_s=1.5):
    sock.send_multipart((b"", (0).to_bytes(8, "big")))
    frames = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            frames.append(sock.recv_multipart())
            if frames[-1][1] == b"\xff" * 8:
                break
    return frames


def test_a_replay_without_the_key_gets_nothing(publisher, keys, tmp_path):
    ctx = zmq.Context()
    _, replay_at = endpoints(publisher)
    try:
        # the pickers' key replays the batch, once the publisher's thread has buffered it
        frames = wait_for(lambda: replay(connect(ctx, zmq.DEALER, replay_at, keys))[:-1],
                          what="the batch replayed to the pickers' key")
        batch = decode_batch(frames[0][2])
        assert batch.events[0].token_ids == SECRET_PROMPT
        assert replay(connect(ctx, zmq.DEALER, replay_at)) == []  # plain: refused
        init(str(tmp_path / "rogue"))  # a CURVE client with a key of its own
        rogue = ZmqSecurity(str(tmp_path / "rogue"))
        sock = ctx.socket(zmq.DEALER)
        rogue.as_client(sock)
        sock.curve_serverkey = zmq.auth.load_certificate(
            str(tmp_path / "keys" / "server.key"))[0]
        sock.connect(replay_at)
        assert replay(sock) == []
    finally:
        ctx.destroy(linger=0)


def test_live_events_reach_only_the_key_holder(publisher, keys):
    ctx = zmq.Context()
    live_at, _ = endpoints(publisher)
    try:
        plain = connect(ctx, zmq.SUB, live_at)
        curve = connect(ctx, zmq.SUB, live_at, keys)
        time.sleep(0.5)  # (subscriptions settle)
        publisher.publish([BlockStored(block_hashes=[2], parent_block_hash=1,
                                       token_ids=SECRET_PROMPT, block_size=4, lora_id=None,
                                       medium="CPU", lora_name=None)])
        assert curve.poll(3000)
        topic, _, payload = curve.recv_multipart()
        assert topic == b"kv@pod@m" and decode_batch(payload).events[0].token_ids == \
            SECRET_PROMPT
        assert not plain.poll(500)
    finally:
        ctx.destroy(linger=0)


def test_the_keys_folder_cli_writes_both_pairs(tmp_path):
    from sluice.zmq_curve import main

    assert main(["init", str(tmp_path / "k")]) == 0
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]


def test_one_picker_feeds_curve_engines_and_plain_vllm_pods(publisher, keys):
    """Pods marked `sluice.dev/kv-events-curve: "false"` (vLLM pools) are read plain while
    CURVE engines are read with the keys; a CURVE pod is never read without them."""
    from sluice.gateway.events.feed import EventFeeder
    from sluice.gateway.events.sockets import EventSource
    from sluice.gateway.index.local_index import LocalIndex
    from sluice.gateway.index.prefix_index import PrefixIndex

    plain = KVEventPublisher("tcp://*:0", "tcp://*:0", topic="kv@vllm@m")
    feeder = EventFeeder(PrefixIndex(LocalIndex(), None), security=keys)
    keyless = EventFeeder(PrefixIndex(LocalIndex(), None))
    feeder.start()
    keyless.start()
    try:
        plain.publish([BlockStored(block_hashes=[2], parent_block_hash=None,
                                   token_ids=[1, 2, 3, 4], block_size=4, lora_id=None,
                                   medium="CPU", lora_name=None)])
        feeder.add(EventSource("engine:1", "m", *endpoints(publisher), curve=True))
        feeder.add(EventSource("vllm:1", "m", *endpoints(plain), curve=False))
        keyless.add(EventSource("engine:1", "m", *endpoints(publisher), curve=True))
        # Both replays arrive: one batch from each pod, one over CURVE and one plain.
        wait_for(lambda: feeder.batches >= 2)
        assert feeder.errors == 0
        wait_for(lambda: keyless.errors == 1)  # refused, not connected in the clear
        assert keyless.batches == 0 and "engine:1" not in keyless.pods()
    finally:
        feeder.stop()
        keyless.stop()
        plain.close()
