"""What the ext_proc server keeps per HTTP request (one gRPC stream), and the response
headers that report the decision."""

from __future__ import annotations

from sluice.gateway.load.inflight import Attempt
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.scheduler import Decision
from sluice.gateway.server import streamed


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
