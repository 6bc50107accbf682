"""The endpoint picker over its gRPC protocol (ext_proc as Envoy speaks it), against
scripted engines: what it answers at each phase, and the accounting it keeps."""

import json
import time

import grpc
import httpx
import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from picker_harness import (
    ExtProcClient,
    Front,
    PickerThread,
    headers,
    metadata,
    static_core,
    wait_for,
)

from sluice.gateway.envoy.listener import (
    ATTR_AUTHORIZATION,
    ATTR_METHOD,
    ATTR_PATH,
    REQUEST_NAMESPACE,
)
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.messages import (
    DESTINATION,
    KEY_NAME,
    LB_NAMESPACE,
    PICKER_HEADERS,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
)


def body(data) -> pb.ProcessingRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def post(path="/v1/completions", **md):
    return pb.ProcessingRequest(request_headers=headers("POST", path), **md)


def immediate(answer):
    assert answer.HasField("immediate_response"), answer
    r = answer.immediate_response
    return r.status.code, json.loads(r.body), {h.header.key: h.header.raw_value.decode()
                                               for h in r.headers.set_headers}


def destination(answer) -> str:
    common = answer.request_body.response
    assert common.clear_route_cache
    header, priority = [h.header for h in common.header_mutation.set_headers]
    assert header.key == DESTINATION
    assert (priority.key, priority.raw_value) == ("x-sluice-priority", b"0")  # no objective
    meta = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION]
    assert meta.string_value == header.raw_value.decode()  # identical, as GIE asks
    return meta.string_value


@pytest.fixture
def pool():
    states = [{}, {}]
    with Server(fake_engine("ok", states[0])) as a, Server(fake_engine("ok", states[1])) as b:
        gw = static_core([a.port, b.port])
        with PickerThread(gw) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 2)
            yield picker, client, [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
            client.close()


def test_a_request_is_routed_with_fallbacks_in_header_and_metadata(pool):
    _, client, pods = pool
    first, routed = client.exchange(post(), body({"model": "m", "prompt": "hi"}))
    # a client-sent destination, prefill pod or priority is stripped before anything else
    assert list(first.request_headers.response.header_mutation.remove_headers) == [
        DESTINATION, "x-prefiller-host-port", "x-sluice-priority"]
    endpoints = destination(routed).split(",")
    assert sorted(endpoints) == sorted(pods)  # the chosen one, then the other


def test_bad_input_is_an_openai_shaped_4xx_and_nothing_is_routed(pool):
    picker, client, _ = pool
    cases = [(b"{not json", 400), (b'{"prompt": "x"}', 400), (b"[1]", 400),
             (b'{"model": "m", "prompt": "a\\ud800b"}', 400),
             (b'{"model": "m", "prompt": "x", "stream": "yes"}', 400),
             (b'{"model": "nope", "prompt": "x"}', 404)]
    for raw, status in cases:
        answers = client.exchange(post(), body(raw))
        code, err, hdrs = immediate(answers[-1])
        assert code == status, raw
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["code"] == status and hdrs["content-type"] == "application/json"
    assert picker.call(lambda: dict(picker.core.flight.inflight)) == {}


def test_models_health_and_unknown_paths_are_answered_by_the_picker(pool):
    _, client, _ = pool
    (models,) = client.exchange(pb.ProcessingRequest(
        request_headers=headers("GET", "/v1/models", end_of_stream=True)))
    assert [m["id"] for m in json.loads(models.immediate_response.body)["data"]] == ["m"]
    (health,) = client.exchange(pb.ProcessingRequest(
        request_headers=headers("GET", "/health", end_of_stream=True)))
    assert health.immediate_response.status.code == 200
    (missing,) = client.exchange(pb.ProcessingRequest(
        request_headers=headers("GET", "/v2/nothing", end_of_stream=True)))
    assert immediate(missing)[0] == 404
    (wrong,) = client.exchange(pb.ProcessingRequest(
        request_headers=headers("GET", "/v1/completions", end_of_stream=True)))
    assert immediate(wrong)[0] == 405


def test_the_subset_hint_is_honoured(pool):
    _, client, pods = pool
    for _ in range(4):
        hint = metadata(SUBSET_NAMESPACE, {SUBSET: [pods[1]]})
        answers = client.exchange(post(metadata_context=hint), body({"model": "m", "prompt": "x"}))
        assert destination(answers[-1]) == pods[1]
    for subset in ([], ["10.9.9.9:80"]):  # empty, or nobody eligible: 503
        hint = metadata(SUBSET_NAMESPACE, {SUBSET: subset})
        answers = client.exchange(post(metadata_context=hint), body({"model": "m", "prompt": "x"}))
        code, _, hdrs = immediate(answers[-1])
        assert code == 503 and hdrs["retry-after"] == "1"


def test_every_pod_at_its_waiting_limit_sheds_429_until_one_drains(pool):
    picker, client, pods = pool
    limit = picker.cfg.shed_waiting

    def waiting(pod, n):  # a load entry newer than any scrape of this test
        picker.call(lambda: picker.core.loads.put_shared(pod, {
            "waiting": n, "running": 0, "kv_usage": 0.5, "ts_ms": time.time() * 1e3 + 3.6e6}))

    for pod in pods:
        waiting(pod, limit)
    code, err, hdrs = immediate(client.exchange(post(), body({"model": "m", "prompt": "x"}))[-1])
    assert code == 429 and hdrs["retry-after"] == "1" and err["error"]["code"] == 429
    waiting(pods[1], limit - 1)
    answers = client.exchange(post(), body({"model": "m", "prompt": "x"}))
    assert destination(answers[-1]).split(",")[0] in pods


def test_inflight_follows_the_pod_that_served_and_ends_with_the_stream(pool):
    picker, client, pods = pool
    flight = picker.core.flight
    outbox, answers = client.open()
    outbox.put(post())
    answers.get(timeout=10)
    outbox.put(body({"model": "m", "prompt": "hi"}))
    chosen = destination(answers.get(timeout=10)).split(",")[0]
    assert picker.call(lambda: dict(flight.inflight)) == {chosen: 1}
    other = next(p for p in pods if p != chosen)  # Envoy retried on the fallback
    outbox.put(pb.ProcessingRequest(
        response_headers=headers("POST", "/v1/completions"),
        metadata_context=metadata(LB_NAMESPACE, {SERVED: other})))
    added = answers.get(timeout=10).response_headers.response.header_mutation.set_headers
    assert {h.header.key: h.header.raw_value.decode() for h in added}["x-sluice-pod"] == other
    assert picker.call(lambda: dict(flight.inflight)) == {other: 1}
    outbox.put(None)  # the HTTP request is over: Envoy closes the stream
    wait_for(lambda: picker.call(lambda: dict(flight.inflight)) == {})


def test_no_pod_is_503_and_health_services_answer():
    gw = static_core([])
    with PickerThread(gw) as picker:
        client = ExtProcClient(picker.port)
        answers = client.exchange(post(), body({"model": "m", "prompt": "x"}))
        assert immediate(answers[-1])[0] == 404  # a model no engine ever served
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{picker.port}"))
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
        client.close()


def body_first(data, method="POST", path="/v1/completions", authorization=None, **md):
    """A completion's body as Sluice's Envoy sends it: no headers message before it, the
    request line in the attributes (listener.BODY_FIRST_MODE)."""
    msg = body(data)
    attrs = msg.attributes["envoy.filters.http.ext_proc"]
    attrs.update({ATTR_METHOD: method, ATTR_PATH: path})
    if authorization is not None:
        attrs.update({ATTR_AUTHORIZATION: authorization})
    for k, v in md.items():
        getattr(msg, k).CopyFrom(v)
    return msg


def changes(answer) -> tuple[list[str], dict[str, str]]:
    """The request-header changes a body-first answer asks the Lua filter for."""
    assert not answer.request_body.response.HasField("header_mutation")
    c = answer.dynamic_metadata.fields[REQUEST_NAMESPACE].struct_value.fields
    return ([v.string_value for v in c["remove"].list_value.values],
            {k: v.string_value for k, v in c["set"].struct_value.fields.items()})


def test_body_first_routes_with_its_header_changes_in_metadata(pool):
    picker, client, pods = pool
    (answer,) = client.exchange(body_first({"model": "m", "prompt": "hi"}))
    listed = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION]
    # a client's own destination, prefiller or priority header never reaches an engine
    assert changes(answer) == (list(PICKER_HEADERS), {DESTINATION: listed.string_value,
                                                      "x-sluice-priority": "0"})
    assert set(listed.string_value.split(",")) == set(pods)
    # the same checks as on a headers message: bad input, subset hint
    (bad,) = client.exchange(body_first(b"{not json"))
    assert immediate(bad)[0] == 400
    hint = metadata(SUBSET_NAMESPACE, {SUBSET: [pods[1]]})
    (hinted,) = client.exchange(body_first({"model": "m", "prompt": "x"}, metadata_context=hint))
    assert changes(hinted)[1][DESTINATION] == pods[1]
    (wrong,) = client.exchange(body_first({"model": "m", "prompt": "x"}, path="/v1/nothing"))
    assert immediate(wrong)[0] == 404
    # a body with neither headers nor attributes before it: nothing to route on
    (blind,) = client.exchange(body({"model": "m", "prompt": "x"}))
    assert immediate(blind)[0] == 500
    wait_for(lambda: picker.call(lambda: dict(picker.core.flight.inflight)) == {})


def test_body_first_keys_and_inflight():
    with Server(fake_engine("ok", {})) as up:
        gw = static_core([up.port], engine_api_key="sk-engine")
        with PickerThread(gw, keys=ApiKeys("sk-right")) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 1)
            pod = f"127.0.0.1:{up.port}"
            for auth in (None, "Bearer sk-wrong"):
                (refused,) = client.exchange(body_first({"model": "m", "prompt": "x"},
                                                        authorization=auth))
                assert immediate(refused)[0] == 401
            answers = client.exchange(
                body_first({"model": "m", "prompt": "x"}, authorization="Bearer sk-right"),
                pb.ProcessingRequest(response_headers=headers("POST", "/v1/completions"),
                                     metadata_context=metadata(LB_NAMESPACE, {SERVED: pod})))
            # the client's key is removed, then the engines' own set; its name is logged
            assert changes(answers[0]) == ([*PICKER_HEADERS, "authorization"], {
                DESTINATION: pod, "authorization": "Bearer sk-engine",
                "x-sluice-priority": "0"})
            key = answers[0].dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[KEY_NAME]
            assert key.string_value == "default"
            added = answers[1].response_headers.response.header_mutation.set_headers
            assert {h.header.key: h.header.raw_value.decode() for h in added}[
                "x-sluice-pod"] == pod
            wait_for(lambda: picker.call(lambda: dict(gw.flight.inflight)) == {})
            client.close()


def test_through_envoy_a_completion_costs_two_messages_and_an_empty_body_none():
    """Sluice's Envoy sends a completion body first: the body and the response headers are
    the stream's only messages; a POST with no body is Envoy's 400, with no picker call on
    the request path; other methods still get the picker's answer to the headers."""
    with Server(fake_engine("ok", {})) as a, Server(fake_engine("ok", {})) as b:
        gw = static_core([a.port, b.port])
        pods = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        with Front(gw) as front:
            wait_for(lambda: len(gw.registry.active()) == 2)
            sent = "http.sluice.ext_proc.stream_msgs_sent"
            before = front.envoy.stats(sent)[sent]
            r = httpx.post(front.url + "/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 200 and r.headers["x-sluice-pod"] in pods
            assert r.headers["x-sluice-prefix-hit-blocks"] == "0"
            assert front.envoy.stats(sent)[sent] - before == 2
            r = httpx.post(front.url + "/v1/chat/completions?x=1", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.headers["x-sluice-pod"] in pods
            empty = httpx.post(front.url + "/v1/completions")
            assert empty.status_code == 400
            assert empty.json()["error"]["message"] == "request body is empty"
            bad = httpx.post(front.url + "/v1/completions", content=b"{not json")
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
            assert httpx.get(front.url + "/v1/completions").status_code == 405
            assert httpx.get(front.url + "/v1/models").json()["data"][0]["id"] == "m"
            wait_for(lambda: front.picker.call(lambda: dict(gw.flight.inflight)) == {})


@pytest.mark.parametrize("time_answers", [False, True])
def test_through_envoy_answers_are_timed_per_pod_only_when_sent_to_the_picker(time_answers):
    """`EnvoyConfig.time_answers`: a streamed completion's chunks reach the picker, whose
    latency-recorder (in every shipped configuration) times its TTFT and TPOT; without it
    the picker sees the answer's headers only, and records nothing."""
    with Server(fake_engine("ok", {})) as a:
        gw = static_core([a.port])
        pod = f"127.0.0.1:{a.port}"
        with Front(gw, time_answers=time_answers) as front:
            wait_for(lambda: len(gw.registry.active()) == 1)
            client = openai.OpenAI(base_url=front.url + "/v1", api_key="none", max_retries=0)
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="m", prompt="hi", max_tokens=4, stream=True))
            assert text == "t0t1t2"

            def count(name):
                return gw.metrics.registry.get_sample_value(
                    f"sluice_gateway_request_{name}_seconds_count",
                    {"pod": pod, "prompt_tokens": "128"})

            if time_answers:
                wait_for(lambda: count("tpot") == 1)
                ttft = gw.metrics.registry.get_sample_value(
                    "sluice_gateway_request_ttft_seconds_sum", {"pod": pod, "prompt_tokens": "128"})
                tpot = gw.metrics.registry.get_sample_value(
                    "sluice_gateway_request_tpot_seconds_sum", {"pod": pod, "prompt_tokens": "128"})
                assert count("ttft") == 1 and ttft < 0.25 and 0.2 < tpot < 0.6  # 0.3 s apart
            else:
                time.sleep(0.2)  # (nothing to wait for: no timing comes)
                assert count("ttft") is None and count("tpot") is None
