"""FULL_DUPLEX_STREAMED bodies: how GIE-conformant Gateways send a request to the picker.

Envoy Gateway (with Envoy AI Gateway), kgateway and Istio configure ext_proc with
`request_body_mode` and `response_body_mode` FULL_DUPLEX_STREAMED and no mode override;
GIE's protocol (docs/proposals/004-endpoint-picker-protocol) says an EPP MUST support it.
Envoy then sends the request headers, then the body in chunks as they arrive, without
waiting for an answer, and forwards nothing until the picker sends it back. The picker
does what GIE's reference EPP did (pkg/epp/handlers/server.go, pkg/common/envoy/chunking.go
before it moved out of that repository):

- the request headers get no answer yet; the chunks are kept (`BodyBuffer`) up to the
  request size limit, past which the answer is an immediate 413;
- at the end of the body the picker decides on the WHOLE body (a UTF-8 character split
  across two chunks is whole again), then answers the request headers (destination header
  and `envoy.lb` metadata, route cache cleared: `route_headers`), then gives the body back
  unchanged in `streamed_response` chunks, the last with `end_of_stream` (`body_chunks`);
- every response body chunk is given back as it came (`body_chunks` on the response), so
  the answer streams token by token.

Which mode a stream is in is read from `protocol_config`, which Envoy sends with the
first message of each stream; our own Envoy (BUFFERED, or body first) keeps its flow.
"""

from __future__ import annotations

import time

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sluice.gateway.routing.plugins import Served
from sluice.gateway.server.messages import KEY_NAME, LB_NAMESPACE

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# GIE's reference EPP sends at most 62,000 bytes per streamed chunk: some Envoy builds
# refuse a streamed_response over 64 KiB, so a margin under it.
CHUNK_BYTES = 62_000


def modes(req: pb.ProcessingRequest) -> tuple[bool, bool]:
    """(request body streamed, response body streamed), from the stream's first message."""
    if not req.HasField("protocol_config"):
        return False, False
    cfg = req.protocol_config
    return cfg.request_body_mode == FULL_DUPLEX, cfg.response_body_mode == FULL_DUPLEX


class BodyBuffer:
    """The chunks of one request body, until its end; `add` refuses what passes `limit`
    (bytes). Joined once at the end: appending to one bytes object would copy it per
    chunk (a 2 MiB body in 16 KiB chunks: 128 copies of up to 2 MiB)."""

    __slots__ = ("chunks", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = limit

    def add(self, data: bytes) -> bool:
        """Keep `data`; False (nothing kept) when the body would pass the limit."""
        if self.size + len(data) > self.limit:
            return False
        self.chunks.append(data)
        self.size += len(data)
        return True

    def take(self) -> bytes:
        body = b"".join(self.chunks)
        self.chunks = []
        return body


def route_headers(answer: pb.ProcessingResponse, remove: tuple[str, ...],
                  key_name: str | None) -> pb.ProcessingResponse:
    """`messages.route_to(..., after_body=False)`'s answer completed for a streamed request:
    the client's headers in `remove` stripped (those the answer does not set anyway) and
    the key's name in `envoy.lb` metadata. (No content-length: Envoy sends a streamed body
    upstream chunked whatever the answer says; Envoy 1.40 measured.)"""
    mutation = answer.request_headers.response.header_mutation
    setting = {o.header.key for o in mutation.set_headers}
    mutation.remove_headers.extend(h for h in remove if h not in setting)
    if key_name is not None:
        answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
            KEY_NAME].string_value = key_name
    return answer


def body_chunks(body: bytes, end_of_stream: bool, response: bool = False
                ) -> list[pb.ProcessingResponse]:
    """`body` back to Envoy as `streamed_response` mutations of at most CHUNK_BYTES, on the
    request (or `response`) phase; `end_of_stream` on the last. An empty body is one
    empty chunk (it may carry the end of the stream)."""
    answers = []
    for start in range(0, max(len(body), 1), CHUNK_BYTES):
        answer = pb.ProcessingResponse()
        common = (answer.response_body if response else answer.request_body).response
        streamed = common.body_mutation.streamed_response
        streamed.SetInParent()  # (an empty chunk that does not end the stream is still one)
        streamed.body = body[start:start + CHUNK_BYTES]
        streamed.end_of_stream = end_of_stream and start + CHUNK_BYTES >= len(body)
        answers.append(answer)
    return answers



class AnswerTiming:
    """A streamed answer's timing, chunk by chunk: the first chunk carries the first
    token; each SSE `data:` event after it one more (vLLM streams a token, or a few, per
    event); `[DONE]` is no token."""

    __slots__ = ("events", "first", "last", "routed")

    def __init__(self, routed: float) -> None:
        self.routed = routed  # perf_counter() when the picker decided
        self.first: float | None = None
        self.last = routed  # the latest chunk's
        self.events = 0

    def ended(self, chunk: bytes, end_of_stream: bool) -> bool:
        """Count `chunk`; True at the answer's end."""
        if chunk:
            self.last = time.perf_counter()
            if self.first is None:
                self.first = self.last
        self.events += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        return end_of_stream

    def served(self, pod: str, prompt_tokens: int) -> Served:
        """The timing so far (at the answer's end, or when its stream closed first: a
        client that stops reading at `[DONE]` may close it before the last empty chunk)."""
        ttft = None if self.first is None else self.first - self.routed
        tpot = ((self.last - self.first) / (self.events - 1)
                if self.first is not None and self.events > 1 else None)
        return Served(pod, prompt_tokens, ttft, tpot, max(self.events, 0))
