"""Routing plugins in the running picker, over its gRPC protocol against scripted engines:
session affinity keeps a session on its pod while the pod is eligible; flow control, under
saturation, lets the higher priority go first and shares a priority between tenants in
turn, and answers every request or refuses it with 429."""

import json
import queue
import time

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from fake_engine import ThreadServer as Server
from fake_engine import fake_engine
from picker_harness import ExtProcClient, PickerThread, headers, wait_for

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.flow.objectives import Objectives
from sluice.gateway.server.messages import DESTINATION
from sluice.gateway.server.picker import PickerConfig

API = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig"}


def core(servers, doc):
    eps = [Endpoint(pod=f"127.0.0.1:{s.port}", url=s.url, model="m", pool="m")
           for s in servers]
    return RoutingCore(CoreConfig(routing="test", routing_document=doc),
                       StaticDiscovery(eps)), eps


def request(**extra) -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()
    return (pb.ProcessingRequest(request_headers=headers("POST", "/v1/completions", **extra)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True)))


def destination(answer) -> str:
    got = {h.header.key: h.header.raw_value.decode()
           for h in answer.request_body.response.header_mutation.set_headers}
    return got[DESTINATION].split(",")[0]


@pytest.mark.parametrize("header", ["x-session-id", "x-conversation"])
def test_a_session_stays_on_its_pod_while_eligible_and_moves_when_drained(header):
    """(A header of the configuration's own reaches the picker too.)"""
    doc = {**API, "plugins": [
        {"type": "session-affinity-scorer", "parameters": {
            "strategy": "session_id", "sessionIdConfig": {"sources": [{"header": header}]}}},
        {"type": "request-queue-scorer"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "session-affinity-scorer", "weight": 10},
            {"pluginRef": "request-queue-scorer", "weight": 1}]}]}
    with Server(fake_engine("ok", {})) as a, Server(fake_engine("ok", {})) as b, \
            Server(fake_engine("ok", {})) as c:
        gw, eps = core([a, b, c], doc)
        with PickerThread(gw) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: len(gw.registry.active()) == 3)
            first = {destination(client.exchange(*request(**{header: "s1"}))[1])
                     for _ in range(20)}
            others = {destination(client.exchange(*request(**{header: f"o{i}"}))[1])
                      for i in range(12)}
            assert len(first) == 1 and len(others) > 1  # the others spread (no pin yet)
            pod = first.pop()
            picker.call(lambda: gw.registry.update([e for e in eps if e.pod != pod]))
            wait_for(lambda: len(gw.registry.active()) == 2)
            moved = {destination(client.exchange(*request(**{header: "s1"}))[1])
                     for _ in range(20)}
            assert len(moved) == 1 and pod not in moved
            client.close()


def test_flow_control_serves_priorities_in_order_and_tenants_in_turn():
    """One engine; 2 requests in flight saturate it (queueDepthThreshold 1, counting the
    picker's own in-flight requests). Held streams keep requests in flight; each one
    ended frees room for exactly one queued request. A request held over a second asks
    the data plane, once, to wait longer for its answer."""
    doc = {**API, "featureGates": ["flowControl"],
           "plugins": [{"type": "queue-scorer"}],
           "saturationDetector": {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 1.0,
                                  "metricsStalenessThreshold": "10s"},
           "flowControl": {"priorityBands": [{"priority": 10},
                                             {"priority": 0, "maxRequests": 10}]}}
    objectives = Objectives.from_specs(["interactive=10", "batch=0"])
    with Server(fake_engine("ok", {})) as engine:
        gw, _ = core([engine], doc)
        pod = f"127.0.0.1:{engine.port}"
        with PickerThread(gw, PickerConfig(objectives=objectives)) as picker:
            client = ExtProcClient(picker.port)
            wait_for(lambda: gw.loads.row(pod, time.time() * 1000) is not None)
            flow = picker.server.picker.admission.flow
            streams = {}  # name -> (outbox, answers)

            def send(name, objective=None, tenant=None):
                hdrs = {}
                if objective:
                    hdrs = {"x-gateway-inference-objective": objective,
                            "x-gateway-inference-fairness-id": tenant}
                outbox, answers = client.open()
                h, body = request(**hdrs)
                outbox.put(h)
                assert answers.get(timeout=10).HasField("request_headers")
                outbox.put(body)
                streams[name] = (outbox, answers)

            def answer(name, timeout=10.0):
                return streams[name][1].get(timeout=timeout)

            in_flight = ["held0", "held1"]  # oldest first
            for name in in_flight:
                send(name)
                assert answer(name).HasField("request_body")
            wait_for(lambda: gw.flight.inflight.get(pod) == 2)
            queued = [f"{t}{i}" for t, n in (("a", 6), ("b", 2), ("c", 2)) for i in range(n)]
            for name in queued:
                send(name, "batch", name[0])
            send("hi", "interactive", "c")
            queued.append("hi")
            wait_for(lambda: picker.call(lambda: flow.queued("m")) == 11)
            send("a6", "batch", "a")  # its band is full, and nothing is lower
            shed = answer("a6")
            assert shed.immediate_response.status.code == 429
            for name in queued:  # held over a second: the data plane is asked to wait
                keepalive = answer(name, timeout=5)
                assert keepalive.override_message_timeout.seconds == 60, keepalive
            order, priorities = [], {}
            while queued:
                streams[in_flight.pop(0)][0].put(None)  # the oldest request ends
                released = None
                while released is None:  # exactly one queued request goes on
                    for name in queued:
                        try:
                            got = answer(name, timeout=0.01)
                        except queue.Empty:
                            continue
                        assert got.HasField("request_body"), got
                        released = name
                        priorities[name] = {
                            o.header.key: o.header.raw_value for o in
                            got.request_body.response.header_mutation.set_headers
                        }["x-sluice-priority"]
                        break
                queued.remove(released)
                order.append(released)
                in_flight.append(released)
                time.sleep(0.05)  # (a second release would be in flight by now)
                assert gw.flight.inflight.get(pod) == 2
            assert order[0] == "hi"  # the higher priority first
            # and the engine is told each objective's priority
            assert priorities == {n: b"10" if n == "hi" else b"0" for n in order}
            # tenants of one priority in turn, whatever their backlog
            assert [n[0] for n in order[1:]] == list("abcabcaaaa")
            assert picker.call(lambda: flow.queued("m")) == 0
            for name in (*in_flight, "a6"):
                streams[name][0].put(None)
            wait_for(lambda: not gw.flight.inflight.get(pod))
            client.close()
