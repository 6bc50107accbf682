"""Test helpers (no tests here): a scheduler over a scripted view of the pods."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from sluice.gateway.index.prefix_index import PrefixIndex
from sluice.gateway.load.table import LoadTable
from sluice.gateway.routing.config import load_plan, read_document, set_parameters
from sluice.gateway.routing.plugin_context import PluginContext
from sluice.gateway.routing.plugins import RoutingRequest
from sluice.gateway.routing.scheduler import Decision, Route, Scheduler


@dataclass
class Pods:
    """A `PodView` whose answers the test sets."""

    unhealthy: Collection[str] = ()
    inflight_by: dict[str, int] = field(default_factory=dict)
    pending_by: dict[str, int] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)
    default_block_size: int | None = 16
    key_model_of: Callable[[str, str], str | None] = lambda pod, model: None
    roles: dict[str, str] = field(default_factory=dict)

    def is_healthy(self, pod: str) -> bool:
        return pod not in self.unhealthy

    def inflight(self, pod: str) -> int:
        return self.inflight_by.get(pod, 0)

    def pending_prefill(self, pod: str) -> int:
        return self.pending_by.get(pod, 0)

    def block_size(self, pod: str) -> int | None:
        return self.block_sizes.get(pod, self.default_block_size)

    def key_model(self, pod: str, model: str) -> str | None:
        return self.key_model_of(pod, model)

    def role_of(self, pod: str) -> str | None:
        return self.roles.get(pod)

    def index_mode(self) -> str:
        return "local"


def shipped(routing: str = "kv_aware", speculative_ttl_ms: int | None = None,
            pd_threshold: int | None = None) -> dict:
    """A shipped configuration, with the knobs tests turn."""
    doc = read_document(shipped=routing)
    if speculative_ttl_ms is not None:
        doc = set_parameters(doc, "precise-prefix-cache-scorer",
                             speculativeIndexing=speculative_ttl_ms > 0,
                             speculativeTTL=f"{speculative_ttl_ms}ms")
    if pd_threshold is not None:
        doc = set_parameters(doc, "prefix-based-pd-decider", nonCachedTokens=pd_threshold)
    return doc


class ScriptedRouter:
    """A scheduler over `Pods`, with the one-call shape the routing tests use."""

    def __init__(self, doc: dict, index: PrefixIndex, table: LoadTable, pods: Pods,
                 name: str = "test") -> None:
        plan = load_plan(doc, name, PluginContext(index, load_ttl_ms=table.ttl_ms))
        self.plan, self.pods = plan, pods
        self.scheduler = Scheduler(plan, table, pods)

    async def schedule(self, model: str, tokens: list[int], pods: list[str],
                       exclude: frozenset[str] = frozenset(), cache_salt: str | None = None,
                       headers: dict[str, str] | None = None) -> Route | None:
        req = RoutingRequest(model, list(tokens), cache_salt, headers or {})
        return await self.scheduler.schedule(req, pods, exclude)

    async def route(self, model: str, tokens: list[int], pods: list[str],
                    exclude: frozenset[str] = frozenset(), cache_salt: str | None = None,
                    headers: dict[str, str] | None = None) -> Decision | None:
        r = await self.schedule(model, tokens, pods, exclude, cache_salt, headers)
        return None if r is None else r.decode


def make_router(routing: str | dict, index: PrefixIndex, table: LoadTable,
                pods: Pods | None = None, speculative_ttl_ms: int | None = None) -> ScriptedRouter:
    doc = (shipped(routing, speculative_ttl_ms) if isinstance(routing, str) else routing)
    return ScriptedRouter(doc, index, table, pods or Pods(),
                      routing if isinstance(routing, str) else "test")
