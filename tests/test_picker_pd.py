"""The endpoint picker on a pool with prefill and decode pods, over its gRPC protocol (as
Envoy speaks it) against scripted engines: the decode pod is the destination, a long
prompt names a prefill pod in `x-prefiller-host-port`, a short one does not, a client
cannot name one, and the decisions show in response headers and metrics."""

import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import ExtProcClient, PickerThread, headers, metadata, static_core, wait_for

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.server.messages import DESTINATION, LB_NAMESPACE, SERVED
from sluice.gateway.server.picker import PickerConfig

PREFILLER = "x-prefiller-host-port"
LONG = list(range(5000, 5300))  # token ids: no tokenizer needed
SHORT = list(range(5000, 5020))


@pytest.fixture
def pool():
    """Two decode engines and a prefill one; the picker's threshold 100 tokens."""
    with Server(fake_engine("ok", {})) as d0, Server(fake_engine("ok", {})) as d1, \
            Server(fake_engine("ok", {})) as p0:
        roles = {d0: "decode", d1: "decode", p0: "prefill"}
        eps = [Endpoint(pod=f"127.0.0.1:{s.port}", url=s.url, model="m", pool="m", role=r)
               for s, r in roles.items()]
        gw = RoutingCore(CoreConfig(routing="least_load"),
                         StaticDiscovery(eps))
        with PickerThread(gw, PickerConfig()) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 3)
            yield picker, client, [e.pod for e in eps]
            client.close()


def post(**extra):
    return pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions", **extra))


def body(prompt) -> pb.ProcessingRequest:
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def set_headers(answer) -> dict[str, str]:
    common = answer.request_body.response
    assert common.clear_route_cache
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def pd_metric(picker, decision, reason) -> float:
    value = picker.core.metrics.registry.get_sample_value(
        "sluice_gateway_pd_decisions_total", {"decision": decision, "reason": reason})
    return value or 0.0


def test_a_long_prompt_names_the_prefill_pod_and_a_short_one_does_not(pool):
    picker, client, (d0, d1, p0) = pool
    for _ in range(4):
        first, routed = client.exchange(post(**{PREFILLER: "6.6.6.6:1"}), body(LONG))
        # the client's own prefill pod is stripped with its destination
        assert list(first.request_headers.response.header_mutation.remove_headers) == [
            DESTINATION, PREFILLER, "x-sluice-priority"]
        got = set_headers(routed)
        assert got[DESTINATION].split(",")[0] in (d0, d1)  # decode pods only, fallbacks too
        assert set(got[DESTINATION].split(",")) <= {d0, d1}
        assert got[PREFILLER] == p0
    assert pd_metric(picker, "prefill", "uncached_at_threshold") == 4
    _, routed = client.exchange(post(), body(SHORT))
    got = set_headers(routed)
    assert PREFILLER not in got and got[DESTINATION].split(",")[0] in (d0, d1)
    assert pd_metric(picker, "skipped", "short") == 1


def test_the_prefill_pod_counts_in_flight_until_the_answer_begins(pool):
    picker, client, (_, _, p0) = pool
    flight = picker.core.flight
    outbox, answers = client.open()
    outbox.put(post())
    answers.get(timeout=10)
    outbox.put(body(LONG))
    decode = set_headers(answers.get(timeout=10))[DESTINATION].split(",")[0]
    assert picker.call(lambda: dict(flight.inflight)) == {decode: 1, p0: 1}
    assert picker.call(lambda: dict(flight.pending_prefill)) == {decode: len(LONG),
                                                                 p0: len(LONG)}
    outbox.put(pb.ProcessingRequest(
        response_headers=headers("POST", "/v1/completions"),
        metadata_context=metadata(LB_NAMESPACE, {SERVED: decode})))
    added = answers.get(timeout=10).response_headers.response.header_mutation.set_headers
    shown = {h.header.key: h.header.raw_value.decode() for h in added}
    assert (shown["x-sluice-pod"], shown["x-sluice-pd"], shown["x-sluice-prefill-pod"]) == (
        decode, "prefill", p0)
    # the decode engine answers once its prefill leg is done: the prefill pod is free
    assert picker.call(lambda: dict(flight.inflight)) == {decode: 1}
    outbox.put(None)
    wait_for(lambda: picker.call(lambda: dict(flight.inflight)) == {})


def test_a_pool_without_roles_gets_no_prefill_header_nor_pd_headers():
    with Server(fake_engine("ok", {})) as a, Server(fake_engine("ok", {})) as b:
        gw = static_core([a.port, b.port], "least_load")
        with PickerThread(gw) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 2)
            _, routed, shown = client.exchange(post(), body(LONG), pb.ProcessingRequest(
                response_headers=headers("POST", "/v1/completions"),
                metadata_context=metadata(LB_NAMESPACE, {SERVED: f"127.0.0.1:{a.port}"})))
            assert PREFILLER not in set_headers(routed)
            keys = {h.header.key for h in
                    shown.response_headers.response.header_mutation.set_headers}
            assert "x-sluice-pod" in keys and not keys & {"x-sluice-pd", "x-sluice-prefill-pod"}
            assert pd_metric(picker, "skipped", "short") == 0
            client.close()
