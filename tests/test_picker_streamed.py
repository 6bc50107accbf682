"""The picker's streamed mode (FULL_DUPLEX_STREAMED, as GIE-conformant Gateways configure
ext_proc) over its gRPC protocol: the client below speaks to it as Envoy 1.40 does (the
mode in `protocol_config` on the stream's first message; the body chunks sent without
waiting for an answer)."""

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import (
    ExtProcClient,
    PickerThread,
    Stream,
    headers,
    metadata,
    static_core,
    wait_for,
)

from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.messages import (
    DESTINATION,
    KEY_NAME,
    LB_NAMESPACE,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
)
from sluice.gateway.server.picker import PickerConfig
from sluice.gateway.server.streamed import CHUNK_BYTES

FULL_DUPLEX = pb.ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED,
                                       response_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED)
LIMIT = 300_000
SMALL = json.dumps({"model": "m", "prompt": "x"}).encode()


def start(path="/v1/completions", **extra) -> pb.ProcessingRequest:
    md = extra.pop("metadata_context", None)
    return pb.ProcessingRequest(request_headers=headers("POST", path, **extra),
                                protocol_config=FULL_DUPLEX, metadata_context=md)


def chunk(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def chunks(raw: bytes, size: int) -> list[pb.ProcessingRequest]:
    parts = [raw[i:i + size] for i in range(0, len(raw), size)]
    return [chunk(p, end=i == len(parts) - 1) for i, p in enumerate(parts)]


def immediate(answer) -> tuple[int, str]:
    assert answer.HasField("immediate_response"), answer
    r = answer.immediate_response
    err = json.loads(r.body)
    assert set(err["error"]) == {"message", "type", "param", "code"}, err
    return r.status.code, err["error"]["message"]


def streamed_chunk(answer, phase: str) -> tuple[bytes, bool]:
    assert answer.WhichOneof("response") == phase, answer
    mutation = getattr(answer, phase).response.body_mutation
    assert mutation.HasField("streamed_response"), answer
    assert len(mutation.streamed_response.body) <= CHUNK_BYTES
    return mutation.streamed_response.body, mutation.streamed_response.end_of_stream


def streamed_body(s: Stream) -> tuple[bytes, int]:
    """The request body the picker gives back, up to the chunk that ends it; (body, chunks)."""
    body, n = b"", 0
    while True:
        data, end = streamed_chunk(s.get(), "request_body")
        body, n = body + data, n + 1
        if end:
            return body, n


def routed(answer) -> tuple[str, list[str]]:
    """(the endpoints, the headers removed) of the answer to the request headers."""
    assert answer.HasField("request_headers"), answer
    common = answer.request_headers.response
    assert common.clear_route_cache
    set_ = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION]
    assert meta.string_value == set_[DESTINATION]  # identical, as GIE asks
    return meta.string_value, list(common.header_mutation.remove_headers)


@pytest.fixture
def pool():
    with Server(fake_engine("ok", {})) as a, Server(fake_engine("ok", {})) as b:
        gw = static_core([a.port, b.port])
        with PickerThread(gw, PickerConfig(max_body_bytes=LIMIT)) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 2)
            yield picker, client, [f"127.0.0.1:{s.port}" for s in (a, b)]
            client.close()


def test_headers_are_answered_after_the_whole_body_then_the_body_goes_back(pool):
    picker, client, pods = pool
    raw = json.dumps({"model": "m", "prompt": "word " * 40_000}).encode()  # 200 kB
    s = client.stream()
    parts = chunks(raw, 16_384)
    s.send(start(), *parts[:-1])
    assert s.silent()  # no answer before the body's end, not even to the headers
    s.send(parts[-1])
    endpoints, removed = routed(s.get())
    assert sorted(endpoints.split(",")) == sorted(pods)  # the chosen one, then the other
    # (the destination and the priority are set: not removed)
    assert removed == ["x-prefiller-host-port"]
    body, n = streamed_body(s)
    assert body == raw and n == -(-len(raw) // CHUNK_BYTES)  # unchanged, in 62 kB chunks
    chosen = endpoints.split(",")[0]
    assert picker.call(lambda: dict(picker.core.flight.inflight)) == {chosen: 1}
    s.end()
    wait_for(lambda: picker.call(lambda: dict(picker.core.flight.inflight)) == {})


def test_a_character_split_across_chunks_is_decoded_whole(pool):
    _, client, pods = pool
    raw = json.dumps({"model": "m", "prompt": "caf\u00e9 \u4e2d\u6587 \U0001f600"},
                     ensure_ascii=False).encode()
    for cut in range(raw.index(b"\xc3") + 1, len(raw) - 3):  # inside every character
        s = client.stream()
        s.send(start(), chunk(raw[:cut]), chunk(raw[cut:], end=True))
        assert routed(s.get())[0].split(",")[0] in pods
        assert streamed_body(s)[0] == raw
        s.end()


@pytest.mark.parametrize("raw, message", [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid JSON"),  # not UTF-8 as a whole
    (b'{"model": "m", "prompt": "caf\xc3', "not valid JSON"),  # a character cut at the end
    (b'{"model": "m", "prompt": ', "not valid JSON"),
    (b'{"model": "m"}', "'prompt' is required")])
def test_bad_bodies_are_an_openai_400(pool, raw, message):
    picker, client, _ = pool
    s = client.stream()
    s.send(start(), chunk(raw[:5]), chunk(raw[5:], end=True))
    code, text = immediate(s.get())
    assert code == 400 and message in text
    assert picker.call(lambda: dict(picker.core.flight.inflight)) == {}
    s.end()


def test_a_body_over_the_limit_is_an_openai_413_at_once(pool):
    _, client, _ = pool
    s = client.stream()
    s.send(start(), chunk(b"x" * (LIMIT - 10)))
    assert s.silent()
    s.send(chunk(b"x" * 20))  # the body's end has not come: answered now
    code, text = immediate(s.get())
    assert code == 413 and str(LIMIT) in text
    s.end()
    s = client.stream()  # exactly at the limit: routed
    s.send(start(), chunk(SMALL + b" " * (LIMIT - len(SMALL)), end=True))
    routed(s.get())
    s.end()


def test_an_empty_body_is_an_openai_400(pool):
    _, client, _ = pool
    s = client.stream()
    s.send(start(), chunk(b"", end=True))
    assert immediate(s.get()) == (400, "request body is empty")
    s.end()


def test_the_subset_hint_is_honoured_and_none_fitting_is_503(pool):
    _, client, pods = pool
    for _ in range(4):
        s = client.stream()
        s.send(start(metadata_context=metadata(SUBSET_NAMESPACE, {SUBSET: [pods[1]]})),
               chunk(SMALL, end=True))
        assert routed(s.get())[0] == pods[1]
        s.end()
    for subset in ([], ["10.9.9.9:80"]):
        s = client.stream()
        s.send(start(metadata_context=metadata(SUBSET_NAMESPACE, {SUBSET: subset})),
               chunk(SMALL, end=True))
        assert immediate(s.get())[0] == 503
        s.end()


def test_response_chunks_go_back_as_they_came_and_trailers_are_answered(pool):
    _, client, _ = pool
    s = client.stream()
    s.send(start(), chunk(json.dumps({"model": "m", "prompt": "x", "stream": True}).encode(),
                          end=True))
    chosen = routed(s.get())[0].split(",")[0]
    streamed_body(s)
    s.send(pb.ProcessingRequest(response_headers=headers("POST", "/v1/completions"),
                                metadata_context=metadata(LB_NAMESPACE, {SERVED: chosen})))
    shown = s.get().response_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in shown}["x-sluice-pod"] == chosen
    for data in (b"data: one\n\n", b"data: two\n\n"):
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=data)))
        assert streamed_chunk(s.get(), "response_body") == (data, False)
    big = b"z" * (CHUNK_BYTES + 5)  # split at the streamed chunk's limit
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=big)))
    assert [streamed_chunk(s.get(), "response_body") for _ in range(2)] == [
        (big[:CHUNK_BYTES], False), (big[CHUNK_BYTES:], False)]
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
    assert streamed_chunk(s.get(), "response_body") == (b"", True)  # an empty end ends it
    s.send(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    assert s.get().HasField("response_trailers")
    s.end()


def test_request_trailers_end_the_body(pool):
    _, client, _ = pool
    s = client.stream()
    s.send(start(), chunk(SMALL[:7]), chunk(SMALL[7:]),
           pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    routed(s.get())
    assert streamed_chunk(s.get(), "request_body") == (SMALL, False)  # trailers end it
    assert s.get().HasField("request_trailers")
    s.end()
    s = client.stream()  # refused at the trailers: the immediate answer alone
    s.send(start(), chunk(b'{"model": "m"'), pb.ProcessingRequest(
        request_trailers=pb.HttpTrailers()))
    assert immediate(s.get())[0] == 400
    assert s.silent()
    s.end()


def test_a_gateway_that_reports_no_served_endpoint_gets_no_verdict(pool):
    """kgateway forwards no `envoy.lb` metadata: nobody is blamed, nothing is claimed."""
    picker, client, _ = pool
    for _ in range(4):  # (3 failures in a row would eject a pod)
        s = client.stream()
        s.send(start(), chunk(SMALL, end=True))
        routed(s.get())
        streamed_body(s)
        s.send(pb.ProcessingRequest(response_headers=headers("POST", "/v1/completions")))
        assert not s.get().response_headers.response.header_mutation.set_headers
        s.end()
    assert picker.call(lambda: picker.core.health.unhealthy()) == set()
    assert picker.call(lambda: picker.core.metrics.retries._value.get()) == 0


def test_a_keyed_gateway_strips_the_key_and_names_it_in_metadata():
    with Server(fake_engine("ok", {})) as a:
        gw = static_core([a.port])
        with PickerThread(gw, keys=ApiKeys("sk-right")) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 1)
            s = client.stream()
            s.send(start(authorization="Bearer sk-wrong"))
            assert immediate(s.get())[0] == 401  # at once, before any body
            s.end()
            s = client.stream()
            s.send(start(authorization="Bearer sk-right"), chunk(SMALL, end=True))
            answer = s.get()
            assert routed(answer)[1] == ["x-prefiller-host-port", "authorization"]
            fields = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
            assert fields[KEY_NAME].string_value == "default"
            s.end()
            client.close()
