"""The picker's gRPC server: ext_proc plus gRPC health, as GIE defines them, and EDS for the
engines cluster of Sluice's own Envoy (`eds.py`); plaintext, or TLS (`serving_tls.py`).

Health services (grpc.health.v1): `liveness` serves from the start; `readiness`,
the overall "" and `envoy.service.ext_proc.v3.ExternalProcessor` serve once the
routing core has started (discovery, feeds and scrapes running). The picker's
Prometheus metrics are served on their own HTTP port (`metrics_port`; 0: none).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from sluice.gateway.core import RoutingCore
from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.eds import EndpointDiscovery
from sluice.gateway.server.ext_proc import ExternalProcessor
from sluice.gateway.server.picker import EndpointPicker, PickerConfig
from sluice.gateway.server.serving_tls import ServingTls, server_credentials

log = logging.getLogger("sluice.gateway.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_SERVING = health_pb2.HealthCheckResponse.SERVING
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),  # Envoy's buffered bodies
    ("grpc.so_reuseport", 0),
    # No bandwidth-delay probing: on loopback to Envoy it only adds a PING and its ack to
    # the messages of each stream (~0.05 ms CPU per request, docs/benchmarks.md).
    ("grpc.http2.bdp_probe", 0),
    # Envoy pings an idle connection every 30 s (the bootstrap's connection_keepalive); by
    # default gRPC counts those as strikes and sends GOAWAY after ~2 min idle, and the next
    # request pays for a new connection. Envoy is this server's only client: no strikes.
    ("grpc.http2.max_ping_strikes", 0)]
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PickerServer:
    """Owns the routing core's lifetime and the gRPC server on the event loop."""

    def __init__(self, core: RoutingCore, cfg: PickerConfig = PickerConfig(),
                 host: str = "0.0.0.0", port: int = 9002, metrics_port: int = 0,
                 keys: ApiKeys | None = None, tls: ServingTls | None = None,
                 health_port: int = 0) -> None:
        self.core = core
        self.keys = keys or ApiKeys()
        self.picker = EndpointPicker(core, cfg)
        self.health = HealthServicer()
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.picker, self.keys), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.eds = EndpointDiscovery()
        # (destinations only: a client request never goes to a prefill engine, not even as
        # Envoy's last fallback)
        core.registry.on_update.append(
            lambda eps: self.eds.publish(e.pod for e in eps if e.role != PREFILL))
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self.eds, self.server)
        address = f"{host}:{port}"
        self.port = (self.server.add_insecure_port(address) if tls is None else
                     self.server.add_secure_port(address, server_credentials(tls)))
        if not self.port:
            raise OSError(f"the picker cannot listen on {host}:{port}")
        self.metrics_port = metrics_port
        self.tls = tls
        # gRPC health alone, plaintext, on a port of its own (GIE's 9003): kubelet's gRPC
        # probes speak no TLS, and a plaintext port on the main server would serve ext_proc
        # around the TLS (and the client-certificate check) too.
        self.health_server: grpc.aio.Server | None = None
        if health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
            if not self.health_port:
                raise OSError(f"the picker cannot listen on {host}:{health_port}")
        self._reload: asyncio.Task | None = None

    async def start(self) -> None:
        await self.health.set("liveness", _SERVING)
        for name in ("readiness", "", EXT_PROC_SERVICE):
            await self.health.set(name, _NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.core.start()
        self._reload = asyncio.get_running_loop().create_task(self.keys.reload_loop())
        if self.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.metrics_port, registry=self.core.metrics.registry)
        for name in ("readiness", "", EXT_PROC_SERVICE):
            await self.health.set(name, _SERVING)
        log.info("endpoint picker serving ext_proc on port %d (%s); %s", self.port,
                 "plaintext" if self.tls is None else "TLS" if not self.tls.client_ca_file
                 else "mutual TLS",
                 "OPEN: no API keys, every client is served (give --api-key or "
                 "--api-keys-dir)" if self.keys.open else f"{len(self.keys)} API key(s)")

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._reload is not None:
            self._reload.cancel()
        await self.health.enter_graceful_shutdown()
        await self.picker.admission.close()  # (waiting requests are answered 429)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(grace_s)
        await self.core.stop()
