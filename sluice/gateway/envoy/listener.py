"""The listener half of Sluice's Envoy bootstrap: HTTP connection manager, filters, routes.

Part of `bootstrap.render_bootstrap` (see there for the request path). Local replies use the
one error shape of `sluice.openai_error`: {"error": {"message", "type", "param": null, "code"}};
Envoy's `json_format` keeps `%RESPONSE_CODE%` a JSON number when it is the value's only operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.openai_error import error_type

if TYPE_CHECKING:
    from sluice.gateway.envoy.bootstrap import EnvoyConfig

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
# Completions reach the picker body first (no request-headers exchange; see _completion_routes):
# the paths, what Envoy sends of the request line with the body (ext_proc request_attributes,
# keyed by these expressions), and the metadata namespace of the picker's request-header
# changes, which the Lua filter applies ({"remove": [name...], "set": {name: value}}).
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
ATTR_METHOD, ATTR_PATH = "request.method", "request.url_path"
ATTR_AUTHORIZATION = "request.headers['authorization']"  # (absent: no such header)
# Request headers routing reads (flow control's objective and fairness id, session
# affinity's), sent as attributes too: body first, the picker sees no other header.
ROUTING_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective",
                   "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id",
                   "x-session-id", "x-session-token")
ATTR_ROUTING = tuple(f"request.headers['{h}']" for h in ROUTING_HEADERS)
REQUEST_NAMESPACE = "sluice.request"
PICKER_CLUSTER = "sluice_picker"
# The largest request body: Envoy answers 413 beyond it (body_size_limit), and so does the
# picker for a body a Gateway streams to it (server/streamed.py).
MAX_REQUEST_BYTES = 16 << 20
HOLD_HEADERS = "sluice.hold_headers"
ENGINE_CLUSTER = "sluice_engines"
T = "type.googleapis.com/envoy.extensions."


def dur(seconds: float) -> str:
    return f"{seconds:g}s"


# Every status Envoy itself answers with (codec, limits, routing, upstream, timeouts): each gets
# its own `type`; anything else falls to the generic mapper (type APIError).
LOCAL_REPLY_STATUSES = (400, 403, 404, 405, 408, 413, 426, 429, 431, 500, 501, 502, 503, 504)
# ext_proc's own failures have an empty body; these are their messages.
PICKER_FAILURES = ((503, "endpoint picker unavailable"), (504, "endpoint picker timed out"),
                   (500, "endpoint picker failed"))
_CEL = T + "access_loggers.filters.cel.v3.ExpressionFilter"


def _error_json(type_name: str) -> dict:
    return {"json_format": {"error": {"message": "%LOCAL_REPLY_BODY%", "type": type_name,
                                      "param": None, "code": "%RESPONSE_CODE%"}},
            "content_type": "application/json"}


def _cel(expression: str) -> dict:
    return {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel",
                                 "typed_config": {"@type": _CEL, "expression": expression}}}


def _status_is(status: int) -> dict:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": status, "runtime_key": f"sluice.local_reply.{status}"}}}}


def local_reply_config() -> dict:
    """The HCM's `local_reply_config`. Mappers, first match wins:

    1. a reply that already has `content-type: application/json` passes as is: the picker's
       ImmediateResponse carrying that header (and an OpenAI body). Envoy's own replies have no
       content-type yet when mapped, and a picker reply without it gets its text wrapped;
    2. ext_proc's own failures (picker unreachable, stream broken, message timeout; details
       `ext_proc_error...`) get a message;
    3. one mapper per status in LOCAL_REPLY_STATUSES, for the `type`;
    4. anything else: the top-level format, type APIError.
    """
    passthrough = {
        "filter": _cel("'content-type' in response.headers && "
                       "response.headers['content-type'].startsWith('application/json')"),
        "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                                 "content_type": "application/json"}}
    picker_failed = [{
        "filter": {"and_filter": {"filters": [
            _status_is(status), _cel("response.code_details.startsWith('ext_proc')")]}},
        "body": {"inline_string": message},
        "body_format_override": _error_json(error_type(status))}
        for status, message in PICKER_FAILURES]
    by_status = [{"filter": _status_is(s), "body_format_override": _error_json(error_type(s))}
                 for s in LOCAL_REPLY_STATUSES]
    return {"mappers": [passthrough, *picker_failed, *by_status],
            "body_format": _error_json("APIError")}


def _processing_mode(response_headers: bool) -> dict:
    # The picker needs the whole body (prompt) to pick; on the response only the headers and
    # the served-endpoint metadata. Body NONE costs nothing per chunk, yet the gRPC stream
    # stays open until the HTTP stream ends (tests/test_envoy_dataplane.py measures it).
    return {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
            "response_header_mode": "SEND" if response_headers else "SKIP",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}


# The one mode_override the picker may (and should) send with its request-headers answer.
PICKER_MODE = _processing_mode(response_headers=True)
# The completion routes' mode: no request-headers message (the body message carries the
# request line as attributes), so one exchange fewer on the request path. Envoy cannot apply
# header changes from a body answer when it sent no headers: the picker puts them in
# REQUEST_NAMESPACE metadata and the Lua filter applies them. The response headers are asked
# for statically here (there is no headers answer to carry a mode_override), so Envoy's own
# replies on these routes (413, an empty body's 400) also open a picker stream.
BODY_FIRST_MODE = {**PICKER_MODE, "request_header_mode": "SKIP"}
# Applies the picker's request-header changes (REQUEST_NAMESPACE metadata, set by its body
# answer), then re-selects the route: the picked request now matches the routed completion
# route (envoy.lb has the destination) instead of the empty-body one.
_APPLY_REQUEST_CHANGES = f"""
function envoy_on_request(handle)
  local changes = handle:streamInfo():dynamicMetadata():get("{REQUEST_NAMESPACE}")
  if changes == nil then return end
  local headers = handle:headers()
  for _, name in ipairs(changes["remove"] or {{}}) do headers:remove(name) end
  for name, value in pairs(changes["set"] or {{}}) do headers:replace(name, value) end
  handle:clearRouteCache()
end
"""


def _ext_proc(cfg: EnvoyConfig) -> dict:
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": T + "filters.http.ext_proc.v3.ExternalProcessor",
        # No grpc_service timeout: it would bound the whole stream, which lives as long as
        # the HTTP request (the picker's in-flight accounting ends with it).
        "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
        "failure_mode_allow": cfg.failure_mode_allow,
        "status_on_error": {"code": 503},  # picker down or broken: "try again", not a 500
        "message_timeout": dur(cfg.ext_proc_message_timeout_s),
        "max_message_timeout": dur(cfg.ext_proc_max_message_timeout_s),
        # Response headers go to the picker only when it asks, in its answer to the request
        # headers (mode_override = PICKER_MODE): a reply Envoy makes for a request the picker
        # never saw (codec 400/431, 413) must not open a picker stream. Unasked, such a
        # stream delays the reply, turns it into a 503 when the picker is down, or (codec
        # errors) loses it.
        "processing_mode": _processing_mode(response_headers=False),
        "allow_mode_override": True,
        "allowed_override_modes": [PICKER_MODE],
        # With the first message (headers, or a completion's body): what the picker reads.
        "request_attributes": [ATTR_METHOD, ATTR_PATH, ATTR_AUTHORIZATION, *ATTR_ROUTING],
        # forwarding: the picker sees envoy.lb (served endpoint) on the response headers;
        # receiving: Envoy drops picker metadata in namespaces not listed here.
        "metadata_options": {"forwarding_namespaces": {"untyped": [LB_NAMESPACE]},
                             "receiving_namespaces": {"untyped": [LB_NAMESPACE,
                                                                  REQUEST_NAMESPACE]}}}}


def _route(cfg: EnvoyConfig, prefix: str) -> dict:
    return {"match": {"prefix": prefix}, "route": {
        "cluster": ENGINE_CLUSTER,
        "timeout": "0s",  # no total deadline: a generation streams as long as it needs
        "idle_timeout": dur(cfg.stream_idle_timeout_s),
        "retry_policy": {
            # Envoy retries only before response headers went downstream, so a 503 or a
            # reset is retried before the first byte and never mid-stream.
            "retry_on": "connect-failure,reset,refused-stream,retriable-status-codes",
            "retriable_status_codes": [503],
            "num_retries": cfg.num_retries,
            "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"}}},
        # The address that answered (none when no connection was made: the header is then
        # absent), as a header the header_to_metadata filter moves into envoy.lb metadata.
        "response_headers_to_add": [{
            "header": {"key": SERVED_KEY, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


def _post(path: str, routed: bool) -> dict:
    match: dict[str, Any] = {"path": path, "headers": [
        {"name": ":method", "string_match": {"exact": "POST"}}]}
    if routed:  # the picker named the endpoints (its body answer, metadata only)
        match["dynamic_metadata"] = [{"filter": LB_NAMESPACE, "path": [{"key": DEST_HEADER}],
                                      "value": {"present_match": True}}]
    return match


def _completion_routes(cfg: EnvoyConfig) -> list[dict]:
    """POST to a completion path, body first (BODY_FIRST_MODE). First matched before the picker
    answered: then it is the empty-body route, whose 400 Envoy answers when no body (so no
    picker call) came; the picker's answer re-selects (Lua) the routed one. None when ext_proc
    fails open: a request the picker never answered would get that 400 (the prefix routes
    then send completions headers first, as before)."""
    if cfg.failure_mode_allow:
        return []
    mode = BODY_FIRST_MODE
    if cfg.time_answers:
        mode = {**mode, "response_body_mode": "STREAMED"}
    per_route = {"envoy.filters.http.ext_proc": {
        "@type": T + "filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"processing_mode": mode}}}
    routes = []
    for path in COMPLETION_PATHS:
        if not any(path.startswith(p) for p in cfg.route_prefixes):
            continue
        routed = _route(cfg, path)
        routed["match"] = _post(path, routed=True)
        routes += [{**routed, "typed_per_filter_config": per_route},
                   {"match": _post(path, routed=False), "typed_per_filter_config": per_route,
                    "direct_response": {"status": 400,
                                        "body": {"inline_string": "request body is empty"}}}]
    return routes


def _not_found() -> dict:
    # Answered by Envoy alone: neither buffered nor sent to the picker.
    return {"match": {"prefix": "/"},
            "direct_response": {"status": 404, "body": {"inline_string": "no such route"}},
            "typed_per_filter_config": {
                "envoy.filters.http.buffer": {
                    "@type": T + "filters.http.buffer.v3.BufferPerRoute", "disabled": True},
                HOLD_HEADERS: {
                    "@type": T + "filters.http.buffer.v3.BufferPerRoute", "disabled": True},
                "envoy.filters.http.ext_proc": {
                    "@type": T + "filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}}}


def http_connection_manager(cfg: EnvoyConfig) -> dict:
    """The listener's HttpConnectionManager `typed_config` for `cfg` (pure)."""
    filters = [
        # Exact limit, from content-length up front or counted: the buffer filter alone lets
        # an over-limit body through when it arrives in the request's last read.
        {"name": "envoy.filters.http.body_size_limit", "typed_config": {
            "@type": T + "filters.http.body_size_limit.v3.BodySizeLimit",
            "max_request_bytes": cfg.max_request_bytes}},
        # Raises this stream's buffer limit to the body limit: ext_proc BUFFERED and the
        # router's retry copy both need the whole body (else 413 past the connection limit).
        {"name": "envoy.filters.http.buffer", "typed_config": {
            "@type": T + "filters.http.buffer.v3.Buffer",
            "max_request_bytes": cfg.max_request_bytes}},
        _ext_proc(cfg),
        # Holds the headers until the body went through ext_proc: a completion's body answer
        # names its endpoint, and the router picks the upstream when it gets the headers.
        {"name": HOLD_HEADERS, "typed_config": {
            "@type": T + "filters.http.buffer.v3.Buffer",
            "max_request_bytes": cfg.max_request_bytes}},
        {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": T + "filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": _APPLY_REQUEST_CHANGES}}},
        {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
            "@type": T + "filters.http.header_to_metadata.v3.Config",
            "response_rules": [{"header": SERVED_KEY, "remove": True, "on_header_present": {
                "metadata_namespace": LB_NAMESPACE, "key": SERVED_KEY, "type": "STRING"}}]}},
        {"name": "envoy.filters.http.router", "typed_config": {
            "@type": T + "filters.http.router.v3.Router", "suppress_envoy_headers": True}},
    ]
    # A client must not choose its own endpoint: strip the routing headers before any filter.
    strip = {"name": "strip-routing-headers", "typed_config": {
        "@type": T + "http.early_header_mutation.header_mutation.v3.HeaderMutation",
        "mutations": [{"remove": h} for h in (DEST_HEADER, SERVED_KEY)]}}
    hcm: dict[str, Any] = {
        "@type": T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "sluice", "codec_type": "AUTO",  # HTTP/1.1 and h2c
        "server_name": "sluice",
        # The edge: the client is the peer. A client's x-request-id is kept (log correlation).
        "use_remote_address": True, "preserve_external_request_id": True,
        "normalize_path": True, "merge_slashes": True,
        "max_request_headers_kb": cfg.max_request_headers_kb,
        "request_headers_timeout": dur(cfg.request_headers_timeout_s),
        "stream_idle_timeout": dur(cfg.stream_idle_timeout_s),
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST",
                                         "max_headers_count": 100, "idle_timeout": "3600s"},
        # Envoy's 256 MiB default windows let one h2 client pin that much memory per stream.
        "http2_protocol_options": {"max_concurrent_streams": 1024,
                                   "initial_stream_window_size": 1 << 20,
                                   "initial_connection_window_size": 4 << 20},
        "early_header_mutation_extensions": [strip],
        "local_reply_config": local_reply_config(),
        "route_config": {"name": "sluice", "virtual_hosts": [{
            "name": "sluice", "domains": ["*"],
            "routes": [*_completion_routes(cfg), *(_route(cfg, p) for p in cfg.route_prefixes),
                       _not_found()]}]},
        "http_filters": filters}
    if cfg.access_log:
        # Compact, and no Authorization, cookies or query strings (they can carry keys).
        fmt = ('[%START_TIME%] "%REQ(:METHOD)% %REQ_WITHOUT_QUERY(:PATH)% %PROTOCOL%" '
               "%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms "
               '%UPSTREAM_HOST% attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% '
               "key=%DYNAMIC_METADATA(envoy.lb:x-sluice-api-key-name)% "
               "id=%REQ(X-REQUEST-ID)%\n")
        hcm["access_log"] = [{"name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": T + "access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string": fmt}, "formatters": [{
                "name": "envoy.formatter.req_without_query", "typed_config": {
                    "@type": T + "formatter.req_without_query.v3.ReqWithoutQuery"}}]}}}]
    return hcm
