"""llm-d's session-affinity-scorer."""

from __future__ import annotations

import base64
import binascii
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from sluice.gateway.routing.candidate import Candidate
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import ProfileResult, RoutingRequest
from sluice.gateway.routing.registry import PluginError, check_keys, plugin

ENCODED = "encoded_endpoint_header"
SESSION_ID = "session_id"
API_KEY = "api_key"  # a session_id source attribute: the client's API key, by name
MAX_SESSIONS = 100_000  # bound of the session table (least recently used dropped first)


@dataclass(frozen=True)
class SessionAffinityParams:
    strategy: str = ENCODED
    # encoded_endpoint_header: {header}; session_id: {sources: [{header: NAME} |
    # {attribute: api_key}], evictionTtlSeconds}
    encoded_endpoint_header_config: dict = field(default_factory=dict)
    session_id_config: dict = field(default_factory=dict)
    profile_name: str = ""  # the profile whose target is pinned ("": the destination's)

    def __post_init__(self) -> None:
        if self.strategy not in (ENCODED, SESSION_ID):
            raise ValueError(f"strategy must be {ENCODED} or {SESSION_ID}")


@plugin("session-affinity-scorer", SessionAffinityParams)
class SessionAffinityScorer:
    """Keeps a session on the pod that served it last, while that pod is a candidate:
    it scores 1, every other pod 0 (so its weight decides how much load may pull a
    session away). A session whose pod is gone (drained, unhealthy, filtered) goes where
    the rest of the profile says, and stays there.
    - `encoded_endpoint_header` (default): the client echoes the header (default
      `x-session-token`) the picker set on its last answer: base64 of the pod's id.
    - `session_id`: the picker remembers session -> pod for `evictionTtlSeconds` (300)
      after its last request; the session is the first source present: a request header
      (default `x-session-id`) or the client's API key (`attribute: api_key`)."""

    def __init__(self, name: str, params: SessionAffinityParams, ctx: PluginContext) -> None:
        self.name, self.params = name, params
        check_keys(f"{name}: encodedEndpointHeaderConfig",
                   params.encoded_endpoint_header_config, ("header",))
        # (expired sessions are dropped as met, and the table is bounded: no sweep)
        check_keys(f"{name}: sessionIdConfig", params.session_id_config,
                   ("sources", "evictionTtlSeconds", "evictionSweepSeconds"))
        self.header = str(params.encoded_endpoint_header_config.get(
            "header", "x-session-token")).lower()
        cfg = params.session_id_config
        self.sources = cfg.get("sources") or [{"header": "x-session-id"}]
        for s in self.sources:
            if not (isinstance(s, dict) and len(s) == 1 and (
                    isinstance(s.get("header"), str) or s.get("attribute") == API_KEY)):
                raise PluginError(f"{name}: a session source is {{header: NAME}} or "
                                  f"{{attribute: {API_KEY}}}, not {s!r}")
        ttl = cfg.get("evictionTtlSeconds", 300)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise PluginError(f"{name}: evictionTtlSeconds must be a number > 0, not {ttl!r}")
        self.ttl_s = float(ttl)
        # the request headers the picker must pass on to this plugin
        self.reads_headers = frozenset([self.header, *(s["header"].lower()
                                                       for s in self.sources if "header" in s)])
        self._pods: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> pod

    def session(self, req: RoutingRequest) -> str | None:
        for s in self.sources:
            value = (req.headers.get(s["header"].lower()) if "header" in s else req.api_key)
            if value:
                return value
        return None

    def pinned(self, req: RoutingRequest) -> str | None:
        if self.params.strategy == ENCODED:
            token = req.headers.get(self.header)
            try:
                return base64.b64decode(token, validate=True).decode() if token else None
            except (binascii.Error, UnicodeDecodeError):
                return None  # a token from elsewhere: no affinity, never an error
        session = self.session(req)
        got = self._pods.get(session) if session else None
        if got is None or got[1] < time.monotonic():
            return None
        return got[0]

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        pod = self.pinned(req)
        return [1.0 if c.pod == pod else 0.0 for c in cands]

    def pre_request(self, req: RoutingRequest, profile: str,
                    result: ProfileResult) -> tuple[str, ...]:
        session = self.session(req) if self.params.strategy == SESSION_ID else None
        if session and profile == (self.params.profile_name or req.primary):
            self._pods[session] = (result.target.pod, time.monotonic() + self.ttl_s)
            self._pods.move_to_end(session)
            while len(self._pods) > MAX_SESSIONS:
                self._pods.popitem(last=False)
        return ()

    def response_headers(self, pod: str) -> dict[str, str]:
        """The token a client echoes to stay on `pod` (encoded_endpoint_header)."""
        if self.params.strategy != ENCODED:
            return {}
        return {self.header: base64.b64encode(pod.encode()).decode()}

