"""The picker's EDS (state of the world) as Envoy drives it: first request answered, ACKs
not, every change of the discovered engines pushed, prefill engines never published."""

from __future__ import annotations

import logging
import queue
import threading

import grpc
import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2 as ds
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.rpc import status_pb2
from picker_harness import PickerThread, wait_for

from sluice.gateway.core import CoreConfig, RoutingCore
from sluice.gateway.discovery.static import Endpoint, StaticDiscovery
from sluice.gateway.envoy.listener import ENGINE_CLUSTER
from sluice.gateway.server.eds import TYPE_URL, split_pod


def endpoint(pod: str, role: str | None = None) -> Endpoint:
    return Endpoint(pod=pod, url=f"http://{pod}", model="m", role=role)


class Stream:
    """One EDS stream as Envoy holds it: requests sent when the test says, responses
    queued as they come."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.requests: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.calls = eds_pb2_grpc.EndpointDiscoveryServiceStub(self.channel).StreamEndpoints(
            iter(self.requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for resp in self.calls:
                self.responses.put(resp)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err  # only by close()

    def send(self, **fields) -> None:
        self.requests.put(ds.DiscoveryRequest(type_url=TYPE_URL, **fields))

    def next(self, timeout: float = 5.0) -> tuple[ds.DiscoveryResponse, list[str]]:
        resp = self.responses.get(timeout=timeout)
        pods = []
        for res in resp.resources:
            cla = endpoint_pb2.ClusterLoadAssignment()
            assert res.Unpack(cla) and cla.cluster_name == ENGINE_CLUSTER
            pods += [f"{e.endpoint.address.socket_address.address}:"
                     f"{e.endpoint.address.socket_address.port_value}"
                     for loc in cla.endpoints for e in loc.lb_endpoints]
        return resp, sorted(pods)

    def close(self) -> None:
        self.calls.cancel()
        self.channel.close()


@pytest.fixture
def picker():
    eps = [endpoint("127.0.0.1:9001"), endpoint("127.0.0.1:9002", "decode"),
           endpoint("127.0.0.1:9003", "prefill")]
    with PickerThread(RoutingCore(CoreConfig(), StaticDiscovery(eps))) as p:
        yield p


def test_first_request_answered_acks_not_changes_pushed(picker, caplog, monkeypatch):
    # (a logging.config.dictConfig run earlier in the session disables existing loggers)
    monkeypatch.setattr(logging.getLogger("sluice.gateway.eds"), "disabled", False)
    stream = Stream(picker.port)
    try:
        stream.send(resource_names=[ENGINE_CLUSTER])
        first, pods = stream.next()
        assert pods == ["127.0.0.1:9001", "127.0.0.1:9002"]  # the prefill engine left out
        assert first.type_url == TYPE_URL and first.nonce

        stream.send(resource_names=[ENGINE_CLUSTER], version_info=first.version_info,
                    response_nonce=first.nonce)  # ACK
        registry = picker.core.registry
        picker.call(lambda: registry.update([endpoint("127.0.0.1:9002", "decode"),
                                             endpoint("127.0.0.1:9004")]))
        second, pods = stream.next()  # the change, not an answer to the ACK
        assert pods == ["127.0.0.1:9002", "127.0.0.1:9004"]
        assert int(second.version_info) > int(first.version_info)
        assert second.nonce != first.nonce

        with caplog.at_level(logging.WARNING, "sluice.gateway.eds"):
            stream.send(resource_names=[ENGINE_CLUSTER], version_info=first.version_info,
                        response_nonce=second.nonce,
                        error_detail=status_pb2.Status(code=3, message="bad host"))
            wait_for(lambda: "rejected endpoints version" in caplog.text)  # NACK read
            picker.call(lambda: registry.update([endpoint("127.0.0.1:9004")]))
            _, pods = stream.next()  # a NACK is not answered; the next change is
            assert pods == ["127.0.0.1:9004"]
            assert stream.responses.empty()
        assert "rejected endpoints version" in caplog.text and "bad host" in caplog.text
    finally:
        stream.close()


def test_a_stream_opened_later_gets_the_current_set_and_other_clusters_nothing(picker):
    picker.call(lambda: picker.core.registry.update([endpoint("[::1]:8000")]))
    late = Stream(picker.port)
    other = Stream(picker.port)
    try:
        late.send()  # no names: every cluster this server has
        assert late.next()[1] == ["::1:8000"]
        other.send(resource_names=["another"])
        resp, pods = other.next()
        assert pods == [] and not resp.resources
    finally:
        late.close()
        other.close()


def test_split_pod_reads_both_address_families():
    assert split_pod("10.0.0.5:8000") == ("10.0.0.5", 8000)
    assert split_pod("[fd00::5]:8000") == ("fd00::5", 8000)
