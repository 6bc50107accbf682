"""The ext_proc messages the picker builds (server/messages.py): filled in place for speed,
they must equal the plainly constructed messages GIE and Envoy expect; and the picker's
request-line read. Plus the event loop `sluice epp` runs on."""

import asyncio

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct

from sluice.gateway.envoy.listener import PICKER_MODE
from sluice.gateway.server import messages as msg
from sluice.gateway.server.cli import run_loop

OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _options(headers: dict[str, str]) -> list[HeaderValueOption]:
    return [HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()),
                              append_action=OVERWRITE) for k, v in headers.items()]


def _lb(fields: dict) -> Struct:
    s = Struct()
    s.update({msg.LB_NAMESPACE: fields})
    return s


@pytest.mark.parametrize("after_body", [True, False])
@pytest.mark.parametrize("engine_auth", [None, "Bearer engine-key"])
def test_a_route_names_the_endpoints_in_the_header_and_metadata_alike(after_body, engine_auth):
    endpoints = ("10.0.0.1:8000", "10.0.0.2:8000")
    value = ",".join(endpoints)
    headers = {msg.DESTINATION: value}
    if engine_auth:
        headers["authorization"] = engine_auth
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_options(headers)),
                               clear_route_cache=True)
    phase = ({"request_body": pb.BodyResponse(response=common)} if after_body
             else {"request_headers": pb.HeadersResponse(response=common)})
    expected = pb.ProcessingResponse(dynamic_metadata=_lb({msg.DESTINATION: value}), **phase)
    assert msg.route_to(endpoints, after_body, engine_auth) == expected


def test_continuing_asks_for_the_body_and_response_headers_and_strips_as_told():
    mode = json_format.ParseDict(PICKER_MODE, ProcessingMode())
    strip = (msg.DESTINATION, "authorization")
    expected = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=list(strip)))),
        mode_override=mode, dynamic_metadata=_lb({msg.KEY_NAME: "team-a"}))
    assert msg.continue_request_headers(strip, "team-a") == expected
    # an open gateway's answer, built once: no key name, only the picker's own headers
    # stripped (the destination, the prefill pod and the priority: a client chooses none)
    assert msg.CONTINUE_OPEN == pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=[
                msg.DESTINATION, "x-prefiller-host-port", "x-sluice-priority"]))),
        mode_override=mode)


def test_a_disaggregated_route_names_the_prefill_pod_in_llm_d_s_header():
    endpoints = ("10.0.0.1:8000",)
    headers = {msg.DESTINATION: endpoints[0], "x-prefiller-host-port": "10.0.0.9:8000"}
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_options(headers)),
                               clear_route_cache=True)
    expected = pb.ProcessingResponse(dynamic_metadata=_lb({msg.DESTINATION: endpoints[0]}),
                                     request_body=pb.BodyResponse(response=common))
    assert msg.route_to(endpoints, True, prefiller="10.0.0.9:8000") == expected


def test_a_route_tells_the_engine_the_objectives_priority():
    answer = msg.route_to(("10.0.0.1:8000",), True, priority=-3)
    set_headers = answer.request_body.response.header_mutation.set_headers
    assert {o.header.key: o.header.raw_value for o in set_headers}["x-sluice-priority"] == b"-3"


def test_response_headers_are_overwritten_or_added():
    headers = {"x-sluice-pod": "10.0.0.1:8000", "x-sluice-prefix-hit-blocks": "3"}
    assert msg.add_response_headers(headers) == pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=_options(headers)))))


def test_the_request_line_is_read_in_one_pass():
    def http(*items: tuple[str, str], raw: bool = True) -> pb.HttpHeaders:
        return pb.HttpHeaders(headers=HeaderMap(headers=[
            HeaderValue(key=k, raw_value=v.encode()) if raw else HeaderValue(key=k, value=v)
            for k, v in items]))

    full = http((":method", "POST"), (":path", "/v1/completions?api-version=1"),
                ("content-type", "application/json"), ("authorization", "Bearer k"))
    assert msg.request_line(full) == ("POST", "/v1/completions", "Bearer k")
    older = http((":path", "/health"), (":method", "GET"), raw=False)  # `value`, not raw
    assert msg.request_line(older) == ("GET", "/health", None)
    assert msg.request_line(http()) == ("", "", None)


def test_sluice_epp_runs_on_uvloop():
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    got: list[str] = []

    async def main() -> None:
        got.append(await loop_module())

    run_loop(main())
    assert got[0].startswith("uvloop")
