"""Disaggregated prefill/decode: which pod decodes, and whether a prefill pod prefills first.

Roles come from discovery (`discovery.static.parse_role`). A pool *has roles* when at
least one of the request's eligible pods is a prefill pod. Then (llm-d's shape: the
decode pod is the destination, the prefill pod is named in a header):

1. The destination and its fallbacks are chosen by the router's strategy (KV occupancy,
   prefix hits, load) among the decode-capable pods only: role `decode`, `both`, or none
   given. A prefill pod is never the destination (it is a kv_producer: it would refuse
   to decode for a client).
2. The decision. Let U be the prompt's tokens the chosen decode pod would compute itself:
   its prompt tokens minus its predicted prefix-hit tokens (`Decision.prefill_tokens`).
   The request is disaggregated when `threshold_tokens >= 1` and `U >= threshold_tokens`.
   A short or mostly-cached prompt is prefilled by the decode pod (a transfer would cost
   more than the prefill it saves, and the decode pod's cache already holds the rest);
   `threshold_tokens = 0` never disaggregates (llm-d's decider: nonCachedTokens 0).
3. Disaggregated: the same strategy chooses a prefill pod among the prefill pods (their
   prefix hits and load); its `ip:port` (the engine's HTTP API: the pod id everywhere)
   goes in the request header `x-prefiller-host-port`, and the decode engine runs the
   prefill leg there (`sluice.engine.server.disagg`). No healthy prefill pod: the decode
   pod prefills (never a failed request for want of a prefill pod).

A pool without prefill pods routes exactly as before: one `Router.route` call over all
its pods, no threshold, no header. Without a prompt's token ids (no tokenizer could read
it) U is 0: the decode pod prefills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from sluice.gateway.discovery.static import PREFILL
from sluice.gateway.routing.router import Decision, Router

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's; the engine's disagg.PREFILLER_HEADER

# PDRoute.outcome values (metrics labels and the x-sluice-pd response header)
NO_ROLES, PREFILLED, SHORT, NO_PREFILL_POD = "none", "prefill", "short", "no_prefill_pod"


@dataclass(frozen=True)
class PDConfig:
    # llm-d's pd-profile-handler threshold (100 tokens); 0: never disaggregate
    threshold_tokens: int = 100

    def __post_init__(self) -> None:
        assert self.threshold_tokens >= 0, self.threshold_tokens


@dataclass(frozen=True)
class PDRoute:
    decode: Decision            # the destination (and its fallbacks)
    prefill: Decision | None    # the prefill pod's decision; None: the decode pod prefills
    outcome: str                # NO_ROLES, PREFILLED, SHORT or NO_PREFILL_POD


def split_roles(pods: list[str], role_of: Callable[[str], str | None]
                ) -> tuple[list[str], list[str]]:
    """(decode-capable pods, prefill pods), each in `pods`' order."""
    decode: list[str] = []
    prefill: list[str] = []
    for p in pods:
        (prefill if role_of(p) == PREFILL else decode).append(p)
    return decode, prefill


def disaggregate(cfg: PDConfig, uncached_tokens: int) -> bool:
    """The rule of the module docstring, step 2."""
    return cfg.threshold_tokens >= 1 and uncached_tokens >= cfg.threshold_tokens


async def route(router: Router, cfg: PDConfig, model: str, token_ids: list[int],
                pods: list[str], role_of: Callable[[str], str | None],
                cache_salt: str | None = None) -> PDRoute | None:
    """The decode decision and, when the rule says so, the prefill one; None when no
    healthy decode-capable pod is left (a pool of prefill pods only included)."""
    decode_pods, prefill_pods = split_roles(pods, role_of)
    if not prefill_pods:
        d = await router.route(model, token_ids, pods, frozenset(), cache_salt)
        return None if d is None else PDRoute(d, None, NO_ROLES)
    if not decode_pods:
        return None
    d = await router.route(model, token_ids, decode_pods, frozenset(), cache_salt)
    if d is None:
        return None
    if not disaggregate(cfg, d.prefill_tokens):
        return PDRoute(d, None, SHORT)
    p = await router.route(model, token_ids, prefill_pods, frozenset(), cache_salt)
    if p is None:
        return PDRoute(d, None, NO_PREFILL_POD)
    # the prefill pod is tried once: the decode engine prefills itself if that leg fails
    return PDRoute(d, dataclasses.replace(p, fallbacks=()), PREFILLED)
