"""Test helpers (no tests here): a real Envoy configured as GIE-conformant Gateways configure
it for an InferencePool backend, with the real picker behind it.

Two shapes, each the settings its project renders (read in their sources):

* `istio`: istio/istio (commit 86c9f01f, 2026-08-22)
  - pilot/pkg/xds/filters/filters.go, `InferencePoolExtProc`: the listener's ext_proc filter,
    grpc_service timeout 10 s, message_timeout 1000 s, metadata_options forwarding and
    receiving the untyped namespace `envoy.lb`;
  - pilot/pkg/networking/core/route/route.go (the InferencePool route's `ExtProcPerRoute`
    overrides): request headers SEND, request body FULL_DUPLEX_STREAMED, request trailers
    SEND, response headers SEND, response body FULL_DUPLEX_STREAMED, response trailers SEND;
    `failure_mode_allow` = the pool's failureMode is FailOpen (default FailClose: false);
    no `allow_mode_override`;
  - pilot/pkg/networking/core/cluster_builder.go, `applyOverrideHostPolicy`: the pool's
    cluster balances with override_host, the hosts read from metadata `envoy.lb` /
    `x-gateway-destination-endpoint`, the one that served written to `envoy.lb` /
    `x-gateway-destination-endpoint-served` (`selected_host_key`). Istio's hosts come by
    EDS from istiod; here they are the engines, static.
* `kgateway`: kgateway-dev/kgateway
  pkg/kgateway/extensions2/plugins/inferenceextension/endpointpicker/plugin.go (read in the
  snapshot of a fork, xieyanke/kgateway 9a2a6904): `HttpFilters` renders the same
  processing mode, message_timeout 5 s, failure_mode_allow false, no metadata options;
  `processBackendObjectIR` an ORIGINAL_DST cluster on header `x-gateway-destination-endpoint`
  (one address: the picker runs with no fallbacks behind it), circuit breakers at 40000.

Envoy AI Gateway (Envoy Gateway's InferencePool support), envoyproxy/ai-gateway
internal/extensionserver/inferencepool.go `buildHTTPFilterForInferencePool`, renders the same
modes (FULL_DUPLEX_STREAMED by default), allow_mode_override false, message_timeout 300 s,
failure_mode_allow false, and an ORIGINAL_DST cluster: the kgateway shape covers it.

The picker's cluster speaks TLS without verifying the certificate, as these Gateways connect
to an EPP by default (kgateway's rendered EPP cluster: an `UpstreamTlsContext` whose
`validationContext` is empty; GIE's EPP serves a self-signed certificate unless given one),
so the picker runs with `--secure-serving` and a certificate made at its start.
One test-only addition to the istio shape: a Gateway's subset hint (GIE leaves how a data
plane derives it to the data plane) comes from request header `x-test-subset` (a comma
list), moved into metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`
by a header_to_metadata filter before ext_proc, and that namespace is forwarded too.
"""

from __future__ import annotations

from typing import Self

from picker_harness import PickerThread

from sluice.gateway.core import RoutingCore
from sluice.gateway.envoy.bootstrap import EnvoyConfig
from sluice.gateway.envoy.process import EnvoyProcess
from sluice.gateway.server.picker import PickerConfig
from sluice.gateway.server.serving_tls import ServingTls

T = "type.googleapis.com/envoy.extensions."
DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE, SUBSET_HEADER = "envoy.lb.subset_hint", "x-test-subset"
SHAPES = ("istio", "kgateway")
STREAMED_MODE = {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
                 "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                 "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"}


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _ext_proc(shape: str) -> dict:
    cfg: dict = {"@type": T + "filters.http.ext_proc.v3.ExternalProcessor",
                 "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
                 "failure_mode_allow": False, "processing_mode": STREAMED_MODE}
    if shape == "istio":
        cfg["grpc_service"]["timeout"] = "10s"
        cfg["message_timeout"] = "1000s"
        cfg["metadata_options"] = {"forwarding_namespaces": {"untyped": ["envoy.lb",
                                                                      SUBSET_NAMESPACE]},
                                   "receiving_namespaces": {"untyped": ["envoy.lb"]}}
    else:
        cfg["message_timeout"] = "5s"
    return {"name": "envoy.filters.http.ext_proc", "typed_config": cfg}


def _pool_cluster(shape: str, engines: list[tuple[str, int]]) -> dict:
    limits = {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000,
                              "max_requests": 40000}]}
    if shape == "kgateway":
        return {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "1000s", "circuit_breakers": limits,
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST}}
    override = {"@type": T + "load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": {"key": "envoy.lb",
                                                        "path": [{"key": DEST}]}}],
                "selected_host_key": {"key": "envoy.lb", "path": [{"key": SERVED}]},
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin", "typed_config": {
                        "@type": T + "load_balancing_policies.round_robin.v3.RoundRobin"}}}]}}
    return {"name": "pool", "type": "STATIC", "connect_timeout": "10s",
            "lb_policy": "CLUSTER_PROVIDED", "circuit_breakers": limits,
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": override}}]},
            "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(h, p)}} for h, p in engines]}]}}


def _subset_hint(shape: str) -> list[dict]:
    if shape != "istio":
        return []
    return [{"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": T + "filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": SUBSET_HEADER, "remove": True, "on_header_present": {
            "metadata_namespace": SUBSET_NAMESPACE,
            "key": "x-gateway-destination-endpoint-subset", "type": "STRING"}}]}}]


def gateway_bootstrap(shape: str, picker_port: int, engines: list[tuple[str, int]]) -> dict:
    """The Envoy bootstrap of a Gateway of `shape` routing every path to one InferencePool
    whose picker listens on `picker_port` (loopback) and whose pods are `engines`."""
    assert shape in SHAPES, shape
    route = {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}
    if shape == "istio":  # its default retries (pilot/pkg/networking/core/route/retry/retry.go)
        route["route"]["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,unavailable,cancelled,"
                        "retriable-status-codes", "num_retries": 2}
    hcm = {"@type": T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "gw", "codec_type": "AUTO",
           "route_config": {"virtual_hosts": [{"name": "gw", "domains": ["*"],
                                               "routes": [route]}]},
           "http_filters": [*_subset_hint(shape), _ext_proc(shape), {
               "name": "envoy.filters.http.router",
               "typed_config": {"@type": T + "filters.http.router.v3.Router"}}]}
    epp = {"name": "epp", "type": "STATIC", "connect_timeout": "10s",
           "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
               "@type": T + "transport_sockets.tls.v3.UpstreamTlsContext",
               "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {}}}},
           "typed_extension_protocol_options": {
               "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                   "@type": T + "upstreams.http.v3.HttpProtocolOptions",
                   "explicit_http_config": {"http2_protocol_options": {}}}},
           "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
               {"endpoint": {"address": _address("127.0.0.1", picker_port)}}]}]}}
    return {"admin": {"address": _address("127.0.0.1", 0)},
            "static_resources": {
                "listeners": [{"name": "sluice_http", "address": _address("127.0.0.1", 0),
                               "filter_chains": [{"filters": [{
                                   "name": "envoy.filters.network.http_connection_manager",
                                   "typed_config": hcm}]}]}],
                "clusters": [_pool_cluster(shape, engines), epp]}}


class GatewayFront:
    """The real picker (in a thread) behind a Gateway-shaped Envoy: `url`, `picker`."""

    def __init__(self, shape: str, gw: RoutingCore, engines: list[tuple[str, int]],
                 cfg: PickerConfig | None = None) -> None:
        self.shape = shape
        self.engines = engines
        # ORIGINAL_DST takes one address: no fallbacks behind it (docs/gateway.md)
        self.picker = PickerThread(gw, cfg or PickerConfig(
            max_fallbacks=2 if shape == "istio" else 0), tls=ServingTls())

    def __enter__(self) -> Self:
        self.picker.__enter__()
        self.envoy = EnvoyProcess(
            EnvoyConfig(listen_host="127.0.0.1", listen_port=0, admin_port=0),
            bootstrap=gateway_bootstrap(self.shape, self.picker.port, self.engines)).start()
        self.url = f"http://127.0.0.1:{self.envoy.listen_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.envoy.stop()
        self.picker.__exit__(*exc)
