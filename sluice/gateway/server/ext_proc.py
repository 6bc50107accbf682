"""`envoy.service.ext_proc.v3.ExternalProcessor`: one gRPC stream per HTTP request.

Envoy (configured by `sluice.gateway.envoy.bootstrap`) sends the request's
headers, then its whole body (BUFFERED), then the response's headers:

- request headers: GET /health is answered at once; then the client's API key is
  checked (`api_keys.py`: 401 without a valid one, when keys are configured);
  GET /v1/models and unknown paths are answered at once (ImmediateResponse); for
  the two completion routes the picker strips any client-sent destination or
  `x-prefiller-host-port` header (a client must never choose a pod) and the
  client's key (engines never see it), records the key's name for the access
  log, and waits for the body;
- request body: `EndpointPicker.pick` → the endpoints in the destination header
  and `envoy.lb` metadata, route cache cleared, and for a disaggregated request
  the prefill pod in `x-prefiller-host-port`; or an OpenAI-shaped 4xx/5xx;
- response headers: the endpoint that really served (`envoy.lb` metadata key
  `x-gateway-destination-endpoint-served`) takes over the in-flight accounting,
  the prefill pod's attempt ends (the decode engine answers once its prefill leg
  is done), and `x-sluice-pod` / `x-sluice-prefix-hit-blocks` are added (with
  `x-sluice-pd` / `x-sluice-prefill-pod` in a pool with prefill pods);
- the stream ends when Envoy is done with the HTTP request (answered, reset,
  client gone): the request's in-flight accounting ends there.

A GIE-conformant Gateway (Envoy Gateway, kgateway, Istio) streams the bodies
(FULL_DUPLEX_STREAMED, `streamed.py`): the request headers are answered once the whole
body has come and the picker has decided, with the routing answer, then the body goes
back in chunks; each response body chunk goes back as it came.

Sluice's own Envoy sends completions body first (`listener.BODY_FIRST_MODE`): no
request-headers message, one exchange fewer on the request path. The body message
then carries the request line as attributes; the same checks run on it, and the
body answer's header changes travel as metadata (`messages.body_first`). A
Gateway that sends the headers first (GIE's protocol) gets the flow above.

State: each stream owns its `Exchange`; shared state is the picker's, and
every coroutine runs on the one event loop.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from sluice.gateway.routing.profiles.pd import NO_ROLES
from sluice.gateway.server import messages as msg
from sluice.gateway.server import streamed
from sluice.gateway.server.api_keys import ApiKeys
from sluice.gateway.server.exchange import Exchange, decision_headers, patient
from sluice.gateway.server.picker import ROUTES, EndpointPicker, Pick


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, keys: ApiKeys | None = None) -> None:
        self.picker = picker
        self.keys = keys or ApiKeys()
        # the routing headers, and those the routing plan's plugins read
        self.wanted = msg.ROUTING | picker.core.plan.request_headers
        self.queues = picker.admission.flow is not None  # answers may wait (flow control)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange()
        first = True
        streamed_request = False
        try:
            async for req in request_iterator:
                if first:
                    streamed_request, ex.streamed_response = streamed.modes(req)
                phase = req.WhichOneof("request")
                if phase == "request_headers":
                    answer = self._request_headers(ex, req, streamed_request)
                    if answer is not None:  # (streamed: answered with the body's end)
                        yield answer
                elif phase == "request_body":
                    body = req.request_body
                    if ex.body is not None:
                        work = self._streamed_body(ex, req)
                    elif body.end_of_stream:
                        work = (self._body_first(ex, req) if first else
                                self._request_body(ex, req))
                    else:
                        work = None
                    if work is not None:
                        async for answer in patient(self.queues, work):
                            yield answer
                    else:  # (STREAMED without full duplex is not configured: refuse)
                        yield msg.immediate_error(400, "the request body must be buffered")
                elif phase == "response_headers":
                    yield self._response_headers(ex, req)
                elif phase == "response_body":
                    if ex.streamed_response:
                        if ex.answer is not None:
                            self._time_answer(ex, req.response_body)
                        for answer in streamed.body_chunks(
                                req.response_body.body, req.response_body.end_of_stream,
                                response=True):
                            yield answer
                    else:  # (STREAMED: each chunk waits for this answer)
                        if ex.answer is not None:
                            self._time_answer(ex, req.response_body)
                        yield msg.RESPONSE_BODY_CONTINUE
                elif phase == "request_trailers":
                    refused = False
                    if ex.body is not None:  # (trailers end a streamed body)
                        async for answer in patient(self.queues, self._streamed_body(ex, req)):
                            refused = refused or answer.HasField("immediate_response")
                            yield answer
                    if not refused:
                        yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif phase == "response_trailers":
                    yield msg.RESPONSE_TRAILERS_CONTINUE
                first = False
        finally:
            if ex.answer is not None:  # (its stream closed before its last chunk came)
                self._answered(ex)
            if ex.attempt is not None:
                ex.attempt.done()
            if ex.prefill_attempt is not None:
                ex.prefill_attempt.done()
            if ex.model is not None:
                self.picker.admission.finished(ex.model)

    def _request_headers(self, ex: Exchange, req: pb.ProcessingRequest,
                         streamed_request: bool = False) -> pb.ProcessingResponse | None:
        """The answer to the request headers; None for a streamed completion, whose
        headers are answered when its body has come (`_streamed_body`)."""
        method, path, authorization = msg.request_line(req.request_headers, ex.headers,
                                                       self.wanted)
        answer = self._request_line(ex, req, method, path, authorization,
                                    req.request_headers.end_of_stream)
        if answer is not None:
            return answer
        if streamed_request:
            ex.body = streamed.BodyBuffer(self.picker.cfg.max_body_bytes)
            return None
        # A gateway key stays here (the engines never see it); an open gateway passes
        # the header on, for engines that check their own key (vLLM's --api-key).
        if ex.key_name is None:
            return msg.CONTINUE_OPEN
        return msg.continue_request_headers(remove=(*msg.PICKER_HEADERS, "authorization"),
                                            key_name=ex.key_name)

    async def _body_first(self, ex: Exchange, req: pb.ProcessingRequest
                          ) -> pb.ProcessingResponse:
        """A completion's body with no headers message before it (BODY_FIRST_MODE)."""
        line = msg.attributes_line(req, ex.headers)
        if line is None:  # (Envoy configured without the attributes: nothing to route on)
            return msg.immediate_error(500, "the gateway sent no request line")
        answer = self._request_line(ex, req, *line, empty=False)
        if answer is not None:
            return answer
        # (a client's own x-prefiller-host-port would make the decode engine fetch from
        # wherever it names; the destination header is overwritten by the route anyway)
        return msg.body_first(await self._request_body(ex, req),
                              remove=msg.PICKER_HEADERS if ex.key_name is None
                              else (*msg.PICKER_HEADERS, "authorization"),
                              key_name=ex.key_name)

    def _request_line(self, ex: Exchange, req: pb.ProcessingRequest, method: str, path: str,
                      authorization: str | None, empty: bool) -> pb.ProcessingResponse | None:
        """The answer the request line and the API key decide on their own; None for a
        completion to route (`ex` then knows its kind, key and subset hint)."""
        core = self.picker.core
        if path == "/health" and method == "GET":  # (probes carry no key)
            status, body = core.health_body()
            return msg.immediate(status, json.dumps(body).encode())
        key_name = None
        if not self.keys.open:
            key_name = self.keys.name_of(authorization)
            if key_name is None:
                core.metrics.errors.labels("unauthorized").inc()
                return msg.immediate_error(
                    401, "Incorrect or missing API key: send Authorization: Bearer <key>",
                    headers={"www-authenticate": "Bearer"})
            core.metrics.child(core.metrics.requests, key_name).inc()
        kind = ROUTES.get(path)
        if kind is not None and method == "POST":
            if empty:
                return msg.immediate_error(400, "request body is empty")
            ex.kind, ex.key_name = kind, key_name
            ex.subset = msg.subset_hint(req)
            return None
        if path == "/v1/models" and method == "GET":
            return msg.immediate(200, json.dumps(core.models_body()).encode())
        if kind is not None or path in ("/v1/models", "/health"):
            return msg.immediate_error(405, f"method {method} not allowed on {path}")
        core.metrics.errors.labels("not_found").inc()
        return msg.immediate_error(404, f"no route {path}")

    async def _request_body(self, ex: Exchange, req: pb.ProcessingRequest
                            ) -> pb.ProcessingResponse:
        if ex.kind is None:  # a body on a request already answered
            return msg.REQUEST_BODY_CONTINUE
        result = await self._pick(ex, req, req.request_body.body)
        if not isinstance(result, Pick):
            return result
        return msg.route_to(result.endpoints, after_body=True,
                            engine_auth=self.picker.core.http.authorization,
                            prefiller=result.prefiller, priority=result.priority)

    async def _streamed_body(self, ex: Exchange, req: pb.ProcessingRequest
                             ) -> list[pb.ProcessingResponse]:
        """A chunk of a streamed body (or the trailers that end it): nothing until the
        body is whole or too large; then the answers to the headers and the body."""
        assert ex.body is not None
        done = req.HasField("request_trailers")
        if not done:
            if not ex.body.add(req.request_body.body):
                ex.body = None
                self.picker.core.metrics.errors.labels("too_large").inc()
                return [msg.immediate_error(
                    413, f"request body is larger than {self.picker.cfg.max_body_bytes} "
                         "bytes")]
            done = req.request_body.end_of_stream
        if not done:
            return []
        body, ex.body = ex.body.take(), None
        if not body:
            return [msg.immediate_error(400, "request body is empty")]
        result = await self._pick(ex, req, body)
        if not isinstance(result, Pick):
            return [result]
        headers = streamed.route_headers(
            msg.route_to(result.endpoints, after_body=False,
                         engine_auth=self.picker.core.http.authorization,
                         prefiller=result.prefiller, priority=result.priority),
            remove=msg.PICKER_HEADERS if ex.key_name is None
            else (*msg.PICKER_HEADERS, "authorization"),
            key_name=ex.key_name)
        # (trailers follow the body: its last chunk does not end the stream)
        return [headers, *streamed.body_chunks(body, not req.HasField("request_trailers"))]

    async def _pick(self, ex: Exchange, req: pb.ProcessingRequest, body: bytes
                    ) -> Pick | pb.ProcessingResponse:
        """The picker's decision on the whole `body` (its in-flight accounting started), or
        the immediate answer that refuses the request."""
        assert ex.kind is not None
        subset = msg.subset_hint(req)  # (on every message, or on the headers' only)
        result = await self.picker.pick(ex.kind, body,
                                        ex.subset if subset is None else subset, ex.key_name,
                                        ex.headers)
        if not isinstance(result, Pick):
            return msg.immediate_error(result.status, result.message, result.param,
                                       result.retry_after)
        ex.decision, ex.model, ex.request = result.decision, result.model, result.request
        if self.picker.core.plan.post_response_hooks:  # (timed if the answer comes here)
            ex.answer = streamed.AnswerTiming(time.perf_counter())
        ex.attempt = self.picker.start(result.decision)
        if result.prefill is not None:
            ex.prefill_attempt = self.picker.start(result.prefill)
        if result.pd_outcome != NO_ROLES:
            ex.pd_outcome = result.pd_outcome
        return result

    def _time_answer(self, ex: Exchange, body: pb.HttpBody) -> None:
        """A chunk of a streamed answer: its first is the first token; at its end the
        plan's PostResponse hooks are told (`routing.latency`)."""
        if ex.answer.ended(body.body, body.end_of_stream):
            self._answered(ex)

    def _answered(self, ex: Exchange) -> None:
        """Tell the PostResponse hooks how the answer went (once, if it began)."""
        t, ex.answer = ex.answer, None
        if t is not None and t.first is not None and ex.attempt is not None:
            served = t.served(ex.attempt.d.pod, len(ex.request.token_ids))
            for hook in self.picker.core.plan.post_response_hooks:
                hook.post_response(ex.request, served)

    def _response_headers(self, ex: Exchange, req: pb.ProcessingRequest
                          ) -> pb.ProcessingResponse:
        if ex.decision is None or ex.attempt is None:
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        if msg.LB_NAMESPACE not in req.metadata_context.filter_metadata:
            # The data plane forwards no `envoy.lb` metadata (a Gateway configured without
            # it), so it cannot say who served: no verdict on any pod, and no headers that
            # would claim one. (Ours always forwards it, holding at least the destination.)
            ex.attempt.prefilled()
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        served = msg.metadata_string(req, msg.LB_NAMESPACE, msg.SERVED)
        ex.attempt = self.picker.served(ex.attempt, served)
        ex.attempt.prefilled()  # (the answer began: its prefill is no longer pending)
        prefill_pod = None
        if ex.prefill_attempt is not None:
            prefill_pod = ex.prefill_attempt.d.pod
            ex.prefill_attempt.done()  # (the decode engine answers after its prefill leg)
        if served is None:  # Envoy's own answer: no engine was reached
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        headers = decision_headers(ex.decision, served)
        for plugin in self.picker.core.plan.response_header_plugins:
            headers.update(plugin.response_headers(served))
        if ex.pd_outcome is not None:
            headers["x-sluice-pd"] = ex.pd_outcome
            if prefill_pod is not None:
                headers["x-sluice-prefill-pod"] = prefill_pod
        return msg.add_response_headers(headers)
