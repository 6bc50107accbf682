"""Envoy ext_proc messages the picker sends (built from xds-protos, nothing by hand).

GIE's contract (docs: ../shared/ANCHORS.md, "Gateway API Inference Extension"):
the chosen `ip:port` and its fallbacks, comma-separated, go in the request header
`x-gateway-destination-endpoint` *and* in dynamic metadata `envoy.lb` under the
same key, identical; the route cache is cleared so Envoy routes on them. A
disaggregated request also carries llm-d's `x-prefiller-host-port` (the prefill
pod's `ip:port`), which only the picker may set: the client's is stripped.

Every request builds two or three of these, so they are filled in place
(`add()`, field assignment): nested constructor keywords cost ~3x as much in
upb (12 -> 4 us for the response headers; docs/benchmarks.md). The one answer
that never varies is built once (`CONTINUE_OPEN`).
"""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf import json_format

from sluice.gateway.envoy.listener import (
    ATTR_AUTHORIZATION,
    ATTR_METHOD,
    ATTR_PATH,
    ATTR_ROUTING,
    PICKER_MODE,
    REQUEST_NAMESPACE,
    ROUTING_HEADERS,
)
from sluice.openai_error import error_json

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
PREFILLER = "x-prefiller-host-port"  # llm-d's header: the decode engine prefills there
# The request's objective priority (higher first), for engines that schedule by priority
# (`sluice engine --scheduling-policy priority`); set on every routed request, so neither
# this header nor the body's own `priority` field lets a client choose its priority.
PRIORITY = "x-sluice-priority"
KEY_NAME = "x-sluice-api-key-name"  # the client key's name, for the access log
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
# Asked for with the answer to a completion's headers: its body buffered, then its
# response headers (Envoy's own replies to requests never routed stay off the picker).
_MODE = json_format.ParseDict(PICKER_MODE, ProcessingMode())


def header_value(h: HeaderValue) -> str:
    """Envoy fills raw_value, older ones value."""
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


ROUTING = frozenset(ROUTING_HEADERS)


def request_line(msg: pb.HttpHeaders, routing: dict[str, str] | None = None,
                 wanted: frozenset[str] = ROUTING) -> tuple[str, str, str | None]:
    """(method, path without the query, Authorization or None): what the picker reads
    of the request headers (names lower-case: Envoy sends them so), in one pass that
    decodes nothing else; the `wanted` headers present go in `routing`."""
    method = path = ""
    authorization = None
    for h in msg.headers.headers:
        key = h.key
        if key == ":method":
            method = header_value(h)
        elif key == ":path":
            path = header_value(h).split("?", 1)[0]
        elif key == "authorization":
            authorization = header_value(h)
        elif routing is not None and key in wanted:
            routing[key] = header_value(h)
    return method, path, authorization


_ATTRIBUTES = "envoy.filters.http.ext_proc"  # (the key Envoy files the attributes under)


def attributes_line(req: pb.ProcessingRequest, routing: dict[str, str] | None = None
                    ) -> tuple[str, str, str | None] | None:
    """`request_line` from the attributes Envoy sends with a completion's body (no headers
    message came first: listener.BODY_FIRST_MODE); None when it sent none."""
    attrs = req.attributes.get(_ATTRIBUTES)
    if attrs is None:
        return None
    fields = attrs.fields
    if routing is not None:  # (only the headers present are sent)
        for name, attr in zip(ROUTING_HEADERS, ATTR_ROUTING, strict=True):
            if attr in fields:
                routing[name] = fields[attr].string_value
    auth = fields.get(ATTR_AUTHORIZATION)
    return (fields[ATTR_METHOD].string_value if ATTR_METHOD in fields else "",
            fields[ATTR_PATH].string_value if ATTR_PATH in fields else "",
            None if auth is None else auth.string_value)


def body_first(answer: pb.ProcessingResponse, remove: tuple[str, ...],
               key_name: str | None) -> pb.ProcessingResponse:
    """A body answer (`route_to`) for a request whose headers Envoy never sent: its header
    changes, `remove` first, go in REQUEST_NAMESPACE metadata for the Lua filter (Envoy
    drops header mutations it cannot apply); the key's name in `envoy.lb` metadata. Other
    answers (immediate ones) pass as they are."""
    if not answer.HasField("request_body"):
        return answer
    mutation = answer.request_body.response.header_mutation
    changes = answer.dynamic_metadata.fields[REQUEST_NAMESPACE].struct_value.fields
    removed = changes["remove"].list_value
    removed.SetInParent()  # (a list, even an empty one)
    for name in (*remove, *mutation.remove_headers):
        removed.values.add().string_value = name
    put = changes["set"].struct_value.fields
    for option in mutation.set_headers:
        put[option.header.key].string_value = header_value(option.header)
    answer.request_body.response.ClearField("header_mutation")
    if key_name is not None:
        answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
            KEY_NAME].string_value = key_name
    return answer


def _fill(options, headers: dict[str, str]) -> None:
    """Append `headers` (overwrite-or-add) to a repeated HeaderValueOption field."""
    for k, v in headers.items():
        o = options.add()
        o.header.key = k
        o.header.raw_value = v.encode("latin-1")
        o.append_action = _OVERWRITE


def _set(headers: dict[str, str]) -> list[HeaderValueOption]:
    return [HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode("latin-1")),
                              append_action=_OVERWRITE) for k, v in headers.items()]


def continue_request_headers(remove: tuple[str, ...] = (),
                             key_name: str | None = None) -> pb.ProcessingResponse:
    """Go on to the body, with `remove` stripped and the picker's processing mode; the
    client's API key name, if any, in `envoy.lb` metadata (Envoy's access log)."""
    answer = pb.ProcessingResponse()
    answer.request_headers.response.header_mutation.remove_headers.extend(remove)
    answer.mode_override.CopyFrom(_MODE)
    if key_name is not None:
        answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
            KEY_NAME].string_value = key_name
    return answer


# Sent, once, for a request flow control holds: "wait up to this long for my answer" (Envoy
# honours it up to its max_message_timeout: 60 s in Sluice's Envoy, flow control's TTL).
QUEUED_MESSAGE_TIMEOUT_S = 60
QUEUED_KEEPALIVE = pb.ProcessingResponse(
    override_message_timeout={"seconds": QUEUED_MESSAGE_TIMEOUT_S})


# Headers a client must never set: the picker alone chooses the pods.
PICKER_HEADERS = (DESTINATION, PREFILLER, PRIORITY)
# An open gateway's answer to every completion's headers: the same bytes each time.
CONTINUE_OPEN = continue_request_headers(remove=PICKER_HEADERS)


def route_to(endpoints: tuple[str, ...], after_body: bool,
             engine_auth: str | None = None, prefiller: str | None = None,
             priority: int | None = None) -> pb.ProcessingResponse:
    """Send the request to `endpoints[0]`, then the others in order on retries;
    `engine_auth`: the engines' own Authorization header value; `prefiller`: the
    prefill pod's `ip:port` (`x-prefiller-host-port`), for a disaggregated request;
    `priority`: its objective's priority (`PRIORITY`)."""
    assert endpoints and all(":" in e for e in endpoints), endpoints
    value = ",".join(endpoints)
    headers = {DESTINATION: value}
    if engine_auth is not None:
        headers["authorization"] = engine_auth
    if prefiller is not None:
        headers[PREFILLER] = prefiller
    if priority is not None:
        headers[PRIORITY] = str(priority)
    answer = pb.ProcessingResponse()
    common = (answer.request_body if after_body else answer.request_headers).response
    _fill(common.header_mutation.set_headers, headers)
    common.clear_route_cache = True
    answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        DESTINATION].string_value = value
    return answer


REQUEST_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
RESPONSE_BODY_CONTINUE = pb.ProcessingResponse(response_body=pb.BodyResponse())
RESPONSE_TRAILERS_CONTINUE = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def add_response_headers(headers: dict[str, str]) -> pb.ProcessingResponse:
    answer = pb.ProcessingResponse()
    _fill(answer.response_headers.response.header_mutation.set_headers, headers)
    return answer


def immediate(status: int, body: bytes, headers: dict[str, str] | None = None,
              details: str = "") -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=status), body=body, details=details,
        headers=pb.HeaderMutation(set_headers=_set(
            {"content-type": "application/json", **(headers or {})}))))


def immediate_error(status: int, message: str, param: str | None = None,
                    retry_after: int | None = None,
                    headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """An OpenAI-shaped error answered by Envoy on the picker's word."""
    headers = dict(headers or {})
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    return immediate(status, error_json(status, message, param), headers,
                     details=f"sluice_picker_{status}")


def metadata_string(req: pb.ProcessingRequest, namespace: str, key: str) -> str | None:
    ns = req.metadata_context.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key].string_value or None


def subset_hint(req: pb.ProcessingRequest) -> frozenset[str] | None:
    """The data plane's `envoy.lb.subset_hint` endpoints; None: no hint given."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())
