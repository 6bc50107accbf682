"""The routing plugin contracts, in the shape of GIE's scheduling framework and llm-d's
plugins: a request is scheduled by a profile handler that runs one or more scheduling
profiles; a profile is filters, then a weighted sum of scorers, then a picker.

Every plugin instance has a `name` (its key in the configuration) and a `type` (its
registered type name, `registry.py`). A plugin may implement several contracts: the
prefix-cache scorers are also `DataProducer`s (they look up the prompt's hits before
scoring) and `PreRequest` hooks (they record the decision).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from sluice.gateway.routing.candidate import Candidate


@dataclass
class RoutingRequest:
    """What the plugins know of one request. `token_ids` is empty when no plugin of the
    configuration reads the prompt, or no tokenizer could read it."""

    model: str
    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    api_key: str | None = None  # the API key's name (never the key)
    pool_roles: frozenset[str | None] = frozenset()  # the roles of its pool's pods
    primary: str = ""  # the profile naming the destination, once the handler said
    # (key seed, block size) -> the prompt's request keys: made once per request, shared
    # by every profile and prefix plugin that reads them
    keys_by: dict[tuple[str, int], list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProfileResult:
    """One profile's outcome: the candidates it ranked, best first (the picker's order),
    and their scores."""

    ranked: tuple[Candidate, ...]
    scores: tuple[float, ...]
    cold: bool  # no candidate held any of the prompt's blocks

    def __post_init__(self) -> None:
        assert self.ranked and len(self.ranked) == len(self.scores)

    @property
    def target(self) -> Candidate:
        return self.ranked[0]


@dataclass(frozen=True)
class SchedulingResult:
    """The profile handler's answer: every profile that ran (None: no candidate was left
    to it), and which one names the destination."""

    results: Mapping[str, ProfileResult | None]
    primary: str
    prefill: str | None = None  # the profile whose target prefills (x-prefiller-host-port)
    outcome: str = "none"  # the handler's verdict, e.g. the P/D decision (metrics label)

    @property
    def target(self) -> ProfileResult | None:
        return self.results.get(self.primary)


@runtime_checkable
class Filter(Protocol):
    name: str

    def filter(self, req: RoutingRequest, cands: list[Candidate]) -> list[Candidate]:
        """A sub-list of `cands`. A soft filter returns `cands` itself rather than an
        empty list (fail open); a hard one (a role filter) may return none."""


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, req: RoutingRequest, cands: list[Candidate]) -> list[float]:
        """One score per candidate, in [0, 1], higher is better."""


@runtime_checkable
class DataProducer(Protocol):
    """Fills what a scorer needs per candidate before any profile scores (GIE's
    PrepareData): the prefix plugins' predicted hits."""

    name: str

    async def prepare(self, req: RoutingRequest, cands: list[Candidate]) -> None: ...


@runtime_checkable
class Picker(Protocol):
    name: str

    def pick(self, req: RoutingRequest, cands: list[Candidate],
             scores: list[float]) -> list[int]:
        """Indices into `cands`, the chosen one first, then every other candidate in
        the order it should be tried (the fallbacks). A permutation of range(len)."""


@runtime_checkable
class ProfileHandler(Protocol):
    """Chooses the profiles a request runs (called until it names none) and makes one
    result of theirs (GIE's ProfileHandler)."""

    name: str

    def pick_profiles(self, req: RoutingRequest, profiles: Mapping[str, object],
                      results: Mapping[str, ProfileResult | None]) -> list[str]: ...

    def process_results(self, req: RoutingRequest,
                        results: Mapping[str, ProfileResult | None]) -> SchedulingResult: ...


@runtime_checkable
class PreRequest(Protocol):
    """Told the result before the request is sent (GIE's PreRequest): plugins that
    learn from their own decisions (prefix history, session affinity)."""

    name: str

    def pre_request(self, req: RoutingRequest, profile: str,
                    result: ProfileResult) -> tuple[str, ...]:
        """Record the profile's target; the request keys written as short-lived
        (speculative) index entries, which the picker renews while the request runs."""


@dataclass(frozen=True)
class Served:
    """What happened to a request, as the data plane reported it (PostResponse)."""

    pod: str
    prompt_tokens: int
    ttft_s: float | None = None  # None: no first token (an error, or no streamed body)
    tpot_s: float | None = None  # mean time per output token after the first
    output_tokens: int = 0


@runtime_checkable
class PostResponse(Protocol):
    name: str

    def post_response(self, req: RoutingRequest, served: Served) -> None: ...
