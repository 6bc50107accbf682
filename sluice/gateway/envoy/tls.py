"""TLS in Sluice's Envoy: downstream on the listener, its certificate read through file-based
SDS; upstream to the picker when it serves TLS (`picker_transport_socket`).

Given a certificate chain and a private key (PEM files, in one folder), the listener speaks
TLS only: 1.2 or later, ALPN h2 and http/1.1 (the HCM's AUTO codec then follows ALPN).

Envoy reads a certificate named in the bootstrap once, but reads one delivered by SDS again
when the files change. So the bootstrap points at an SDS file (`EnvoyConfig.tls_sds_file`,
written beside it by the bootstrap CLI or `EnvoyProcess`) whose one Secret names the files
and watches their folder. A Kubernetes Secret volume swaps its files in one rename (its
`..data` symlink), which is how cert-manager's renewals arrive: Envoy serves the new
certificate on new connections, without a restart.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.gateway.envoy.bootstrap import EnvoyConfig

SECRET_NAME = "sluice_tls"
SDS_FILE = "tls-sds.yaml"  # the SDS file's name when written beside the bootstrap
_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."


def enabled(cfg: EnvoyConfig) -> bool:
    """True with a certificate and a key; ValueError with one of them only, or no SDS file."""
    if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
        raise ValueError("tls_cert_file and tls_key_file go together")
    if cfg.tls_cert_file and not cfg.tls_sds_file:
        raise ValueError("TLS needs tls_sds_file (where the SDS file is written)")
    return bool(cfg.tls_cert_file)


def transport_socket(cfg: EnvoyConfig) -> dict:
    """The listener filter chain's `transport_socket`: TLS, the certificate from SDS."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": _TLS + "DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            "tls_certificate_sds_secret_configs": [{
                "name": SECRET_NAME,
                "sds_config": {"path_config_source": {"path": cfg.tls_sds_file},
                               "resource_api_version": "V3"}}]}}}


def sds_resources(cfg: EnvoyConfig) -> dict:
    """The SDS file's content: the certificate and key files, their folder watched."""
    return {"resources": [{
        "@type": _TLS + "Secret", "name": SECRET_NAME,
        "tls_certificate": {
            "certificate_chain": {"filename": cfg.tls_cert_file},
            "private_key": {"filename": cfg.tls_key_file},
            "watched_directory": {"path": posixpath.dirname(cfg.tls_cert_file) or "."}}}]}


def picker_transport_socket(cfg: EnvoyConfig, host_is_ip: bool) -> dict:
    """The picker cluster's TLS (`cfg.picker_tls`): ALPN h2; with `picker_ca_file`, the
    picker's certificate must chain to that CA and name `picker_host` (else it is encrypted
    to but not verified: a self-signed picker); with a client pair, mutual TLS."""
    if bool(cfg.picker_client_cert_file) != bool(cfg.picker_client_key_file):
        raise ValueError("picker_client_cert_file and picker_client_key_file go together")
    common: dict = {"alpn_protocols": ["h2"],
                    "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"}}
    if cfg.picker_ca_file:
        common["validation_context"] = {
            "trusted_ca": {"filename": cfg.picker_ca_file},
            "match_typed_subject_alt_names": [{
                "san_type": "IP_ADDRESS" if host_is_ip else "DNS",
                "matcher": {"exact": cfg.picker_host}}]}
    if cfg.picker_client_cert_file:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": cfg.picker_client_cert_file},
            "private_key": {"filename": cfg.picker_client_key_file}}]
    context: dict = {"@type": _TLS + "UpstreamTlsContext", "common_tls_context": common}
    if not host_is_ip:
        context["sni"] = cfg.picker_host
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}
