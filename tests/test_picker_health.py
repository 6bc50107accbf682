"""Pod health in the picker: probes and failed attempts, never one request's answer;
ejection bounded to a fraction of the pool."""

import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import ExtProcClient, PickerThread, headers, metadata, static_core, wait_for

from sluice.gateway.discovery.health import HealthTracker
from sluice.gateway.routing.scheduler import Decision
from sluice.gateway.server.messages import LB_NAMESPACE, SERVED


def test_ejection_is_bounded_to_a_fraction_of_the_pool():
    pods = ["a:1", "b:1", "c:1", "d:1"]
    h = HealthTracker(max_failures=1, max_ejection_fraction=0.5, pool_size=lambda: len(pods))
    for _ in range(3):
        for p in pods:
            h.connection_failure(p)
    assert h.unhealthy() == {"a:1", "b:1"}  # two of four, whatever the failures
    h.probed("a:1", True)  # back: room for one more
    h.connection_failure("c:1")
    assert h.unhealthy() == {"b:1", "c:1"}
    one = HealthTracker(max_failures=1, max_ejection_fraction=0.0, pool_size=lambda: 1)
    one.connection_failure("x:1")
    assert one.unhealthy() == {"x:1"}  # at least one pod may always be ejected


def test_failures_must_be_consecutive_and_probes_judge_alone():
    h = HealthTracker(max_failures=3, probe_failures=2, pool_size=lambda: 2)
    for _ in range(5):
        h.connection_failure("a:1")
        h.connection_failure("a:1")
        h.success("a:1")  # an answer served in between: not in a row
    assert h.is_healthy("a:1")
    h.probed("b:1", False)
    assert h.is_healthy("b:1")  # one failed probe is not enough
    h.probed("b:1", False)
    assert not h.is_healthy("b:1")
    h.probed("b:1", True)
    assert h.is_healthy("b:1")


def route(client, prompt="hi"):
    _, answer = client.exchange(
        pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions")),
        pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps({"model": "m", "prompt": prompt}).encode(), end_of_stream=True)))
    assert answer.HasField("request_body"), answer
    return answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value.split(",")


@pytest.fixture
def two_pods():
    bad_st, ok_st = {}, {}
    with Server(fake_engine("error500", bad_st)) as bad, Server(fake_engine("ok", ok_st)) as ok:
        gw = static_core([bad.port, ok.port], probe_interval_s=0.2, max_failures=2)
        with PickerThread(gw) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 2)
            yield picker, client, f"127.0.0.1:{bad.port}", f"127.0.0.1:{ok.port}"
            client.close()


def test_a_pod_whose_health_fails_is_taken_out_by_the_probes(two_pods):
    picker, client, bad, ok = two_pods
    wait_for(lambda: not picker.call(lambda: picker.core.health.is_healthy(bad)))
    assert picker.call(lambda: picker.core.health.is_healthy(ok))
    assert all(route(client, f"p{i}") == [ok] for i in range(4))


def test_retried_attempts_eject_the_primary_and_answers_never_do():
    with Server(fake_engine("ok", {})) as a, Server(fake_engine("ok", {})) as b:
        gw = static_core([a.port, b.port], probe_interval_s=60, max_failures=2)
        pods = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        with PickerThread(gw) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 2)

            def chosen_then_served(chosen, served):
                """One request the picker sends to `chosen` (the subset hint), whose
                response Envoy says `served` served."""
                hint = metadata("envoy.lb.subset_hint",
                                {"x-gateway-destination-endpoint-subset": [chosen]})
                client.exchange(
                    pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions"),
                                         metadata_context=hint),
                    pb.ProcessingRequest(request_body=pb.HttpBody(
                        body=b'{"model": "m", "prompt": "x"}', end_of_stream=True)),
                    pb.ProcessingRequest(response_headers=headers("POST", "/v1/completions"),
                                         metadata_context=metadata(LB_NAMESPACE,
                                                                   {SERVED: served})))

            # an answer of any status from the chosen pod: never a failure
            for _ in range(6):
                chosen_then_served(pods[0], pods[0])
            # served by a pod the picker never named (Envoy's DNS view lagging a new
            # pod, or every named one tried): no verdict on the chosen one
            for _ in range(4):
                chosen_then_served(pods[0], pods[1])
            assert picker.call(lambda: gw.health.unhealthy()) == set()

            def moved_to_fallback(chosen, fallback):
                """Envoy served a request from the fallback the picker named."""
                d = Decision(chosen, "round_robin", 0, 0, "none",
                             fallbacks=(fallback,))
                picker.call(lambda: picker.server.picker.served(
                    picker.server.picker.start(d), fallback).done())

            moved_to_fallback(pods[0], pods[1])
            chosen_then_served(pods[0], pods[0])  # an answer between: not in a row
            moved_to_fallback(pods[0], pods[1])
            assert picker.call(lambda: gw.health.unhealthy()) == set()
            moved_to_fallback(pods[0], pods[1])
            assert picker.call(lambda: gw.health.unhealthy()) == {pods[0]}
            # the other pod cannot be ejected too: two pods, one ejected at most
            for _ in range(4):
                moved_to_fallback(pods[1], pods[0])
            assert picker.call(lambda: gw.health.unhealthy()) == {pods[0]}
            wait_for(lambda: picker.call(lambda: dict(gw.flight.inflight)) == {})
            client.close()
