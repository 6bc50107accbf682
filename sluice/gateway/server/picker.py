"""The endpoint picker's decision for one request, free of any wire protocol.

`pick(kind, body, subset, key_name, headers)`:
1. the body is checked (`requests.parse_request`): 400 on anything malformed;
2. the model selects the pool: 404 for a model no engine ever served, 503 with
   Retry-After when none of its engines is ready;
3. the subset hint, when the data plane gives one, narrows the pool: an empty
   or ineligible subset is a 503;
4. shedding: when every eligible pod's waiting queue is at `shed_waiting`, 429
   with Retry-After (the engines would queue it or refuse it themselves);
5. admission (`admission.py`): a saturated pool's request waits its turn by
   priority and tenant (flow control), or is refused with 429 (503 when it
   waited out its TTL); then the API key's per-minute limits (`rate_limit.py`),
   counted after tokenizing;
6. the prompt is tokenized (when a plugin of the routing plan reads it, and in
   pools with prefill pods; large prompts off the event loop; by a pod's
   `/tokenize` when the picker has no tokenizer for the model) and the plan's
   scheduler chooses (`routing/scheduler.py`): the pod, then up to
   `max_fallbacks` others, best first, and in a pool with prefill pods a prefill
   pod when its profile handler says so (`routing/profiles/pd.py`).

In-flight accounting (`InFlight`) follows the pod that really served: the data
plane reports it with the response, and `served()` moves the attempt there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field

from sluice.gateway.core import RoutingCore
from sluice.gateway.discovery.pod_client import POD_ERRORS
from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.envoy.listener import MAX_REQUEST_BYTES
from sluice.gateway.flow.controller import Shed
from sluice.gateway.flow.objectives import Objectives
from sluice.gateway.load.inflight import Attempt
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.profiles.pd import NO_ROLES
from sluice.gateway.routing.scheduler import Decision
from sluice.gateway.server.admission import Admission
from sluice.gateway.server.rate_limit import Limits, RateLimiter
from sluice.gateway.server.requests import BadRequest, parse_request

log = logging.getLogger("sluice.gateway.picker")

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
INLINE_TOKENIZE_BYTES = 16 * 1024  # larger bodies are tokenized on a worker thread
REMOTE_TOKENIZE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class PickerConfig:
    max_fallbacks: int = 2  # endpoints after the primary (Envoy's retries use them)
    shed_waiting: int = 1024  # every pod this deep in waiting requests: 429
    limits: Limits = field(default_factory=Limits)  # per API key, per minute (rate_limit.py)
    objectives: Objectives = field(default_factory=Objectives)  # priorities (admission.py)
    # A body a Gateway streams (FULL_DUPLEX_STREAMED) is gathered up to this: 413 beyond.
    # (A buffered body is bounded by our Envoy, with the same default.)
    max_body_bytes: int = MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        assert self.max_fallbacks >= 0 and self.shed_waiting >= 1 and self.max_body_bytes > 0


@dataclass(frozen=True)
class Rejection:
    status: int
    message: str
    param: str | None = None
    retry_after: int | None = None


@dataclass(frozen=True)
class Pick:
    decision: Decision
    prefill: Decision | None = None  # the prefill pod's, when the request is disaggregated
    pd_outcome: str = NO_ROLES       # the profile handler's outcome (`profiles/pd.py`)
    model: str = ""                  # its pool's key in flow control
    request: RoutingRequest | None = None  # what the routing plugins were shown
    priority: int = 0                # its objective's (flow/objectives.py)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return (self.decision.pod, *self.decision.fallbacks)

    @property
    def prefiller(self) -> str | None:
        """The `x-prefiller-host-port` value: the prefill pod's `ip:port`, or None."""
        return None if self.prefill is None else self.prefill.pod


class EndpointPicker:
    def __init__(self, core: RoutingCore, cfg: PickerConfig = PickerConfig()) -> None:
        self.core = core
        self.cfg = cfg
        self.limiter = RateLimiter(cfg.limits, core.redis.aio if core.redis else None)
        self.admission = Admission(core)

    async def pick(self, kind: str, body: bytes, subset: frozenset[str] | None = None,
                   key_name: str | None = None,
                   headers: dict[str, str] | None = None) -> Pick | Rejection:
        core = self.core
        try:
            data = parse_request(kind, body)
        except BadRequest as err:
            core.metrics.errors.labels("bad_request").inc()
            return Rejection(400, err.message, err.param)
        model = data["model"]
        pods = core.registry.pods_for(model)
        if not pods:
            if core.registry.may_serve(model):
                core.metrics.errors.labels("no_pod").inc()
                return Rejection(503, f"no engine of model {model!r} is ready", retry_after=1)
            core.metrics.errors.labels("unknown_model").inc()
            return Rejection(404, f"The model `{model}` does not exist.", "model")
        if subset is not None:
            pods = [p for p in pods if p in subset]
            if not pods:
                core.metrics.errors.labels("no_pod").inc()
                return Rejection(503, "no eligible engine in the endpoint subset",
                                 retry_after=1)
        decode_pods = [p for p in pods if core.registry.role_of(p) != PREFILL]
        has_roles = len(decode_pods) < len(pods)
        if self._saturated(decode_pods or pods):
            core.metrics.errors.labels("shed").inc()
            return Rejection(429, f"every engine of {model!r} has {self.cfg.shed_waiting} "
                                  "or more requests waiting", retry_after=1)
        headers = headers or {}
        priority = self.cfg.objectives.priority(model, key_name, headers)
        queued = await self.admission.admit(model, decode_pods or pods, key_name, headers,
                                            len(body), priority)
        if isinstance(queued, Shed):
            core.metrics.errors.labels("shed").inc()
            return Rejection(queued.status, f"the engines of {model!r} are saturated: "
                                            f"request not admitted ({queued.reason})",
                             retry_after=queued.retry_after_s)
        try:
            return await self._route(kind, data, body, model, pods, has_roles, key_name,
                                     headers, priority)
        finally:
            if queued:
                self.admission.placed(model)

    async def _route(self, kind: str, data: dict, body: bytes, model: str, pods: list[str],
                     has_roles: bool, key_name: str | None,
                     headers: dict[str, str], priority: int) -> Pick | Rejection:
        """Tokenize, rate-limit, schedule (steps 5 (its limits) and 6 of the module docstring)."""
        core = self.core
        started = time.perf_counter()
        token_ids = await self._token_ids(kind, data, len(body), pods, has_roles)
        if key_name is not None and self.cfg.limits.any:
            # every prompt of the body (about 4 bytes a token where none was tokenized),
            # plus n completions of max_tokens each
            cost = max(len(token_ids or ()), len(body) // 4) + _requested_tokens(data)
            wait_s = await self.limiter.admit(key_name, cost)
            if wait_s is not None:
                core.metrics.errors.labels("rate_limited").inc()
                return Rejection(429, f"rate limit of API key {key_name!r} reached for this "
                                      "minute", retry_after=wait_s)
        salt = data.get("cache_salt")
        req = RoutingRequest(model, token_ids or [], salt if isinstance(salt, str) else None,
                             headers, key_name)
        r = await core.scheduler.schedule(req, pods)
        if r is None:
            core.metrics.errors.labels("no_pod").inc()
            return Rejection(503, "no healthy engine for this model", retry_after=1)
        d = r.decode
        core.metrics.route_seconds.observe(time.perf_counter() - started)
        core.metrics.decided(d.strategy, d.pod, d.hit_blocks, d.total_blocks)
        if r.outcome != NO_ROLES:
            core.metrics.pd_decided(r.outcome)
        if len(d.fallbacks) > self.cfg.max_fallbacks:
            d = dataclasses.replace(d, fallbacks=d.fallbacks[:self.cfg.max_fallbacks])
        return Pick(d, r.prefill, r.outcome, model, req, priority)

    def _saturated(self, pods: list[str]) -> bool:
        loads, now_ms, limit = self.core.loads, time.time() * 1000, self.cfg.shed_waiting
        return all((r := loads.row(p, now_ms)) is not None and r["waiting"] >= limit
                   for p in pods)

    async def _token_ids(self, kind: str, data: dict, size: int, pods: list[str],
                         for_pd: bool = False) -> list[int] | None:
        """The prompt's ids: the picker's own tokenizer for the model, else the
        `/tokenize` of one of its pods (vLLM's endpoint, which our engine serves too);
        None (routing without prefix, counted as a `tokenize` error) when neither can.
        Read when a plugin of the plan reads the prompt, or `for_pd` (its length decides)."""
        core = self.core
        if not core.plan.uses_prompt and not for_pd:
            return None
        started = time.perf_counter()
        try:
            if size > INLINE_TOKENIZE_BYTES:
                ids = await asyncio.to_thread(core.tokenizer.token_ids, kind, data)
            else:
                ids = core.tokenizer.token_ids(kind, data)
            if ids is None:
                ids = await self._remote_token_ids(kind, data, pods)
        except Exception as err:  # noqa: BLE001 -- the engine judges the prompt itself
            ids = None
            log.debug("tokenization failed (%s); routing without prefix", err)
        core.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        if ids is None:
            core.metrics.errors.labels("tokenize").inc()
        return ids

    async def _remote_token_ids(self, kind: str, data: dict,
                                pods: list[str]) -> list[int] | None:
        url = self.core.registry.url_of(pods[0])
        if url is None:
            return None
        if kind == "chat":
            body = {k: data[k] for k in ("model", "messages", "add_generation_prompt", "tools",
                                         "chat_template_kwargs") if data.get(k) is not None}
        else:
            prompt = data["prompt"]
            prompt = prompt[0] if isinstance(prompt, list) else prompt  # a batch: the first
            if not isinstance(prompt, str):
                return None
            body = {"model": data["model"], "prompt": prompt}
        try:
            status, raw = await self.core.http.post_json(url + "/tokenize", body,
                                                         REMOTE_TOKENIZE_TIMEOUT_S)
        except POD_ERRORS:
            return None
        tokens = json.loads(raw).get("tokens") if status == 200 else None
        return tokens if isinstance(tokens, list) else None

    def start(self, d: Decision) -> Attempt:
        return self.core.flight.start(d)

    def served(self, attempt: Attempt, pod: str | None) -> Attempt:
        """The data plane says `pod` served (None: no pod could be reached). Envoy
        moves on from the chosen pod to a named fallback only when it refused or
        reset the connection or answered 503 before any byte: a failed attempt of
        that pod, which the health tracker counts (bounded ejection). A pod the
        picker never named served when Envoy did not know the chosen one yet (its
        DNS view lags a new pod) or had tried them all: no verdict on the chosen one.
        The attempt moves to `pod`."""
        if pod == attempt.d.pod:
            self.core.health.success(pod)
            return attempt
        if pod is None or pod in attempt.d.fallbacks:
            self.core.health.connection_failure(attempt.d.pod)
        self.core.metrics.retries.inc()
        attempt.done()
        if pod is None:
            return attempt
        moved = dataclasses.replace(attempt.d, pod=pod, hit_blocks=0, spec_keys=(),
                                    fallbacks=())
        return self.start(moved)


UNBOUNDED_COMPLETION_TOKENS = 1024  # counted for a request that sets no max_tokens


def _requested_tokens(data: dict) -> int:
    """The completion tokens a request may cost: n x max_tokens (or its chat name);
    `UNBOUNDED_COMPLETION_TOKENS` each when it sets none. (The engine judges bad values.)"""
    n = data.get("n")
    n = n if type(n) is int and n > 0 else 1
    limit = data.get("max_completion_tokens") or data.get("max_tokens")
    limit = limit if type(limit) is int and limit > 0 else UNBOUNDED_COMPLETION_TOKENS
    return n * limit
