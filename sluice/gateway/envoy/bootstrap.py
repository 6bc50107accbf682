"""The Envoy v3 static bootstrap of Sluice's data plane: one listener, ext_proc to the picker.

Request path: early strip of client routing headers -> body_size_limit (413) -> buffer ->
ext_proc (the picker reads the whole body, names `ip:port` endpoints; completions body first,
listener.BODY_FIRST_MODE) -> buffer (holds the headers until then) -> Lua (applies a body-first
answer's header changes) -> header_to_metadata -> router. Envoy 1.40 does fallbacks only over hosts a cluster already knows, hence two shapes:

* no `endpoints` and no `eds`: ORIGINAL_DST routes to the ONE `ip:port` in request header
  `x-gateway-destination-endpoint` (a comma list there is an invalid host: 503). Retries go to
  that same host; there are no fallbacks.
* `eds` (the picker's own endpoint set, by EDS from the picker: what the chart runs), or
  `endpoints` (static `ip:port`s, or one `name:port` resolved by DNS): the
  override_host LB policy reads the ordered comma list in metadata `envoy.lb` /
  `x-gateway-destination-endpoint`; each retry takes the next host of the list.

The picker answers the same to both: header and metadata "primary,fallback,..." (one value, as
GIE asks; behind ORIGINAL_DST run it with `--max-fallbacks 0`, docs/gateway.md), and
reads the endpoint that answered in `envoy.lb` / `x-gateway-destination-endpoint-served` on the
response-headers message. `render_bootstrap` is pure; `python -m sluice.gateway.envoy.bootstrap
--out f.yaml` is the CLI the chart and images run, so this module is the file's one source.
With a certificate the listener speaks TLS (`tls.py`; the CLI then also writes the SDS file).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from sluice.gateway.envoy import tls
from sluice.gateway.envoy.listener import (
    DEST_HEADER,
    ENGINE_CLUSTER,
    LB_NAMESPACE,
    MAX_REQUEST_BYTES,
    PICKER_CLUSTER,
    PICKER_MODE,
    SERVED_KEY,
    T,
    dur,
    http_connection_manager,
)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
__all__ = ["DEST_HEADER", "LB_NAMESPACE", "PICKER_MODE", "SERVED_KEY", "EnvoyConfig",
           "render_bootstrap", "render_yaml", "write_config"]


@dataclass(frozen=True)
class EnvoyConfig:
    """Everything the data plane's file depends on. Times in seconds, sizes in bytes."""

    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    admin_host: str = "127.0.0.1"  # admin stays on loopback: it can quit the server
    admin_port: int = 9901  # 0: the kernel picks (see EnvoyProcess.admin_port)
    picker_host: str = "127.0.0.1"
    picker_port: int = 9002
    # Empty: ORIGINAL_DST (one host per request, no fallbacks). Else the engines as "ip:port"
    # (STATIC) or one "name:port" (STRICT_DNS, e.g. the InferencePool's headless Service).
    endpoints: tuple[str, ...] = ()
    # The engines from the picker's EDS (picker_host:picker_port): Envoy's hosts are exactly
    # the endpoints the picker may name. Excludes `endpoints`.
    eds: bool = False
    route_prefixes: tuple[str, ...] = ("/v1/",)  # other paths: 404 from Envoy
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_request_headers_kb: int = 64
    connection_buffer_bytes: int = 1 << 20
    connect_timeout_s: float = 2.0
    stream_idle_timeout_s: float = 300.0  # idle, not total: a long generation is fine
    request_headers_timeout_s: float = 10.0
    num_retries: int = 2
    ext_proc_message_timeout_s: float = 5.0
    # Ceiling for the picker's override_message_timeout (e.g. while it queues a request).
    ext_proc_max_message_timeout_s: float = 60.0
    failure_mode_allow: bool = False  # no picker, no routing: never guess an endpoint
    # Completions' answers go to the picker chunk by chunk (response body STREAMED), so it
    # times each pod's TTFT and TPOT (the latency-recorder plugin): one ext_proc message
    # more per chunk. Off: the picker sees the answer's headers only.
    time_answers: bool = False
    picker_health_check: bool = True
    # TLS to the picker (`sluice epp --secure-serving`): verified against picker_ca_file when
    # given; a client certificate (PEM files) where the picker requires one.
    picker_tls: bool = False
    picker_ca_file: str = ""
    picker_client_cert_file: str = ""
    picker_client_key_file: str = ""
    max_concurrency: int = 100_000  # circuit breakers: LLM streams are long and many
    dns_refresh_s: float = 5.0
    access_log: bool = True
    # Downstream TLS (tls.py): PEM files, both or neither; "" = plain HTTP. The SDS file that
    # names them ("": tls-sds.yaml beside the bootstrap, see write_config).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_sds_file: str = ""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _split_host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _load_assignment(name: str, endpoints: list[tuple[str, int]]) -> dict:
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}]}


def _circuit_breakers(cfg: EnvoyConfig) -> dict:
    # Envoy's defaults (1024 requests) would cap in-flight streams, and each in-flight request
    # also holds one ext_proc stream to the picker.
    n = cfg.max_concurrency
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": n,
                            "max_pending_requests": n, "max_requests": n,
                            "max_retries": max(1, n // 10)}]}


def _http_options(h2: bool, idle_s: float) -> dict:
    proto = ({"http2_protocol_options": {"connection_keepalive": {"interval": "30s",
                                                                 "timeout": "5s"}}}
             if h2 else {"http_protocol_options": {}})
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": T + "upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": {"idle_timeout": dur(idle_s)},
        "explicit_http_config": proto}}


def _engine_cluster(cfg: EnvoyConfig) -> dict:
    cluster: dict[str, Any] = {
        "name": ENGINE_CLUSTER, "connect_timeout": dur(cfg.connect_timeout_s),
        "per_connection_buffer_limit_bytes": cfg.connection_buffer_bytes,
        "circuit_breakers": _circuit_breakers(cfg),
        "typed_extension_protocol_options": _http_options(h2=False, idle_s=60)}
    if cfg.eds and cfg.endpoints:
        raise ValueError("eds and endpoints exclude each other")
    if not cfg.endpoints and not cfg.eds:
        return {**cluster, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "cleanup_interval": "60s",  # keeps idle engines' pooled connections warm
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DEST_HEADER}}
    override = {
        "@type": T + "load_balancing_policies.override_host.v3.OverrideHost",
        # Metadata only: it carries the whole ordered list. The header (the same list) as a
        # second source would name the primary again and spend a retry on it.
        "override_host_sources": [
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DEST_HEADER}]}}],
        # Named hosts all tried or unknown (e.g. DNS not yet refreshed): least-request.
        "fallback_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.least_request", "typed_config": {
                "@type": T + "load_balancing_policies.least_request.v3.LeastRequest"}}}]}}
    cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": override}}]}
    if cfg.eds:
        return {**cluster, "type": "EDS", "eds_cluster_config": {"eds_config": {
            "resource_api_version": "V3", "api_config_source": {
                "api_type": "GRPC", "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": PICKER_CLUSTER}}]}}}}
    hosts = [_split_host_port(e) for e in cfg.endpoints]
    dns = not all(_is_ip(h) for h, _ in hosts)
    if dns and len(hosts) != 1:
        raise ValueError("endpoints: a list of ip:port, or exactly one dns-name:port")
    cluster["load_assignment"] = _load_assignment(ENGINE_CLUSTER, hosts)
    if not dns:
        return {**cluster, "type": "STATIC"}
    # A headless Service: one host per A/AAAA record, re-resolved every dns_refresh_s (the
    # typed DNS cluster: the Cluster-level DNS fields are deprecated in Envoy 1.40).
    cluster["cluster_type"] = {"name": "envoy.cluster.dns", "typed_config": {
        "@type": T + "clusters.dns.v3.DnsCluster", "dns_lookup_family": "ALL",
        "dns_refresh_rate": dur(cfg.dns_refresh_s), "respect_dns_ttl": False}}
    return cluster


def _picker_cluster(cfg: EnvoyConfig) -> dict:
    cluster: dict[str, Any] = {
        "name": PICKER_CLUSTER, "type": "STATIC" if _is_ip(cfg.picker_host) else "STRICT_DNS",
        "connect_timeout": dur(cfg.connect_timeout_s),
        "circuit_breakers": _circuit_breakers(cfg),
        "typed_extension_protocol_options": _http_options(h2=True, idle_s=3600),
        "load_assignment": _load_assignment(PICKER_CLUSTER,
                                            [(cfg.picker_host, cfg.picker_port)])}
    if cfg.picker_tls:
        cluster["transport_socket"] = tls.picker_transport_socket(cfg, _is_ip(cfg.picker_host))
    elif cfg.picker_ca_file or cfg.picker_client_cert_file:
        raise ValueError("picker_ca_file and a client certificate need picker_tls")
    if cfg.picker_health_check:
        cluster["health_checks"] = [{
            "timeout": "1s", "interval": "5s", "unhealthy_threshold": 2, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE}}]
    return cluster


def render_bootstrap(cfg: EnvoyConfig) -> dict:
    """The whole Envoy v3 bootstrap for `cfg`, as plain dicts/lists/str/int/bool/None.

    Pure: same config, same dict; no file, network or environment access.
    """
    chain: dict[str, Any] = {"filters": [{
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": http_connection_manager(cfg)}]}
    if tls.enabled(cfg):
        chain["transport_socket"] = tls.transport_socket(cfg)
    return {
        "node": {"id": "sluice-gateway", "cluster": "sluice"},
        "admin": {"address": _address(cfg.admin_host, cfg.admin_port)},
        "overload_manager": {"resource_monitors": [{  # a ceiling on client connections
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": T + "resource_monitors.downstream_connections.v3"
                ".DownstreamConnectionsConfig",
                "max_active_downstream_connections": cfg.max_concurrency}}]},
        "static_resources": {
            "listeners": [{
                "name": "sluice_http", "address": _address(cfg.listen_host, cfg.listen_port),
                "per_connection_buffer_limit_bytes": cfg.connection_buffer_bytes,
                "filter_chains": [chain]}],
            "clusters": [_engine_cluster(cfg), _picker_cluster(cfg)]}}


def render_yaml(cfg: EnvoyConfig) -> str:
    """`render_bootstrap(cfg)` as YAML (key order kept, so diffs of the file stay readable)."""
    return yaml.safe_dump(render_bootstrap(cfg), sort_keys=False, width=100)


def write_config(cfg: EnvoyConfig, path: str) -> EnvoyConfig:
    """Write the bootstrap to `path` and, with TLS, the SDS file (tls-sds.yaml beside it
    unless `cfg` names one); the config as written."""
    if cfg.tls_cert_file and not cfg.tls_sds_file:
        sds = os.path.join(os.path.dirname(os.path.abspath(path)), tls.SDS_FILE)
        cfg = dataclasses.replace(cfg, tls_sds_file=sds)
    text = render_yaml(cfg)  # (raises before any file is written)
    if tls.enabled(cfg):
        with open(cfg.tls_sds_file, "w") as fh:
            fh.write(yaml.safe_dump(tls.sds_resources(cfg), sort_keys=False))
    with open(path, "w") as fh:
        fh.write(text)
    return cfg


def _parse_args(argv: list[str] | None) -> tuple[EnvoyConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.gateway.envoy.bootstrap",
        description="Write Sluice's Envoy bootstrap (YAML). Flags mirror EnvoyConfig fields.")
    parser.add_argument("--out", default="-", help="file to write; - for stdout")
    for f in dataclasses.fields(EnvoyConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.type.startswith("tuple"):
            parser.add_argument(flag, default=",".join(f.default),
                                help="comma-separated")
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=f.default)
    ns = vars(parser.parse_args(argv))
    out = ns.pop("out")
    for f in dataclasses.fields(EnvoyConfig):
        if f.type.startswith("tuple"):
            ns[f.name] = tuple(x for x in ns[f.name].split(",") if x)
    return EnvoyConfig(**ns), out


def main(argv: list[str] | None = None) -> None:
    cfg, out = _parse_args(argv)
    if out != "-":
        write_config(cfg, out)
    elif cfg.tls_cert_file:
        raise SystemExit("TLS: give --out (the SDS file is written beside it)")
    else:
        sys.stdout.write(render_yaml(cfg))


if __name__ == "__main__":
    main()
