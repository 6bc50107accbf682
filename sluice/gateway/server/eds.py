"""The engines cluster as the picker sees it, served to Envoy by EDS (xDS state of the world).

Why: Envoy routes, and falls back, only to hosts its cluster knows. Fed by DNS, that set
trails the picker's pod watch by the refresh interval plus the resolver's cache, so a pod the
picker names may be unknown to Envoy and a deleted pod may still be Envoy's only host. Served
from here, Envoy's hosts are the picker's endpoints, changed in the same event-loop turn.

Protocol (envoy.service.endpoint.v3 StreamEndpoints, Envoy's `api_type: GRPC`): a stream's
first request is answered with the current ClusterLoadAssignment of `engines`, and every
change after that with another response (version = a counter of changes, one nonce per
response). An ACK (the last nonce, no error) is not answered; a NACK is logged and the same
version is not sent again on that stream. A request for other clusters only gets an empty
answer: this server knows one cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2 as ds
from envoy.service.endpoint.v3 import eds_pb2_grpc

from sluice.gateway.envoy.listener import ENGINE_CLUSTER

log = logging.getLogger("sluice.gateway.eds")

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def split_pod(pod: str) -> tuple[str, int]:
    """`ip:port` or `[ipv6]:port` (static.pod_address) as (ip, port)."""
    host, _, port = pod.rpartition(":")
    return host.strip("[]"), int(port)


def load_assignment(cluster: str, pods: Iterable[str]) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster)
    locality = cla.endpoints.add()
    for pod in pods:
        host, port = split_pod(pod)
        lb = locality.lb_endpoints.add()
        addr = lb.endpoint.address.socket_address
        addr.address, addr.port_value = host, port
    return cla


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """The engines' `ip:port`s (`publish`), streamed to every subscribed Envoy."""

    def __init__(self, cluster: str = ENGINE_CLUSTER) -> None:
        self.cluster = cluster
        self.pods: tuple[str, ...] = ()
        self.version = 0
        self._wakes: set[asyncio.Event] = set()  # one per open stream

    def publish(self, pods: Iterable[str]) -> None:
        """The current endpoint set (event loop thread); streams are woken on a change."""
        new = tuple(sorted(set(pods)))
        if new == self.pods:
            return
        self.pods, self.version = new, self.version + 1
        for wake in self._wakes:
            wake.set()

    def _response(self, names: frozenset[str], nonce: int) -> ds.DiscoveryResponse:
        resp = ds.DiscoveryResponse(version_info=str(self.version), type_url=TYPE_URL,
                                    nonce=str(nonce))
        if not names or self.cluster in names:
            resp.resources.add().Pack(load_assignment(self.cluster, self.pods))
        return resp

    async def StreamEndpoints(self, request_iterator: AsyncIterator[ds.DiscoveryRequest],
                              context) -> AsyncIterator[ds.DiscoveryResponse]:  # gRPC's name
        wake = asyncio.Event()
        stream = _Stream(wake)
        reader = asyncio.get_running_loop().create_task(stream.read(request_iterator))
        self._wakes.add(wake)
        nonce, sent = 0, None
        try:
            while True:
                await wake.wait()
                wake.clear()
                if reader.done():
                    return
                if stream.names is None:  # no request yet
                    continue
                if stream.resend or sent != self.version:
                    nonce += 1
                    stream.resend, sent = False, self.version
                    yield self._response(stream.names, nonce)
        finally:
            self._wakes.discard(wake)
            reader.cancel()


class _Stream:
    """What one Envoy asked for on its stream, read concurrently with the responses."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake
        self.names: frozenset[str] | None = None  # None until the first request
        self.resend = False

    async def read(self, requests: AsyncIterator[ds.DiscoveryRequest]) -> None:
        try:
            async for req in requests:
                if req.type_url and req.type_url != TYPE_URL:
                    log.warning("EDS request for %s ignored", req.type_url)
                    continue
                if req.HasField("error_detail"):
                    log.warning("Envoy rejected endpoints version %s: %s",
                                req.version_info or "(none)", req.error_detail.message)
                names = frozenset(req.resource_names)
                # A first request, or another set of names, gets an answer now; an ACK not.
                if self.names != names or not req.response_nonce:
                    self.names, self.resend = names, True
                    self.wake.set()
        finally:
            self.wake.set()  # the stream ended: the writer returns
