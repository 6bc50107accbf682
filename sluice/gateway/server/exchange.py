"""What the ext_proc server keeps per HTTP request (one gRPC stream), the response
headers that report the decision, and the wait for an answer flow control holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sluice.gateway.load.inflight import Attempt
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.scheduler import Decision
from sluice.gateway.server import messages as msg
from sluice.gateway.server import streamed

KEEPALIVE_AFTER_S = 1.0  # an answer held this long (queued) asks the data plane to wait


class Exchange:
    """What one HTTP request's stream has learnt so far."""

    __slots__ = ("answer", "attempt", "body", "decision", "headers", "key_name", "kind",
                 "model", "pd_outcome", "prefill_attempt", "request", "streamed_response",
                 "subset")

    def __init__(self) -> None:
        self.kind: str | None = None
        # A streamed request body being gathered (None: buffered, or not a completion)
        self.body: streamed.BodyBuffer | None = None
        self.streamed_response = False  # response body chunks must be given back
        self.key_name: str | None = None  # the client's API key, by name
        self.headers: dict[str, str] = {}  # the routing headers present (ROUTING_HEADERS)
        self.model: str | None = None  # a routed request's model (its flow-control pool)
        self.request: RoutingRequest | None = None  # what the plugins were shown
        self.answer: streamed.AnswerTiming | None = None  # its timing (PostResponse hooks)
        self.subset: frozenset[str] | None = None  # the data plane's subset hint
        self.decision: Decision | None = None
        self.attempt: Attempt | None = None
        self.prefill_attempt: Attempt | None = None  # the prefill pod's (disaggregated)
        self.pd_outcome: str | None = None  # the P/D handler's, in a pool with prefill pods


def decision_headers(d: Decision, pod: str) -> dict[str, str]:
    return {"x-sluice-pod": pod, "x-sluice-prefix-hit-blocks": str(d.hit_blocks if
                                                                   pod == d.pod else 0),
            "x-sluice-prompt-blocks": str(d.total_blocks), "x-sluice-strategy": d.strategy,
            "x-sluice-index": d.index_mode}


async def patient(queues: bool, work: Awaitable[pb.ProcessingResponse | list]
                  ) -> AsyncIterator[pb.ProcessingResponse]:
    """The answers `work` gives. With flow control on (`queues`), a request may wait in
    its queue longer than the data plane waits for an answer (Envoy's message_timeout):
    after `KEEPALIVE_AFTER_S` the data plane is asked, once, to wait up to
    `msg.QUEUED_MESSAGE_TIMEOUT_S` (ext_proc's override_message_timeout, which Envoy
    honours up to its max_message_timeout, 60 s in Sluice's Envoy)."""
    if not queues:
        got = await work
    else:
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait((task,), timeout=KEEPALIVE_AFTER_S)
            if not done:
                yield msg.QUEUED_KEEPALIVE
            got = await task
        finally:
            task.cancel()  # (the stream ended first: the client went away)
    for answer in got if isinstance(got, list) else (got,):
        yield answer
