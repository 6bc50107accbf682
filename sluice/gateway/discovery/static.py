"""Where the engines are: one interface, a static list or Kubernetes.

A `Discovery` calls `on_change(endpoints)` with the full current set whenever
it changes (and once at start). An `Endpoint` is one engine pod.

Roles (disaggregated prefill/decode): an endpoint's `role` is `prefill` (it only
prefills for others: never a request's destination), `decode` or `both` (it may be
the destination), or None (no role given: like `both`). `parse_role` reads the
operator's `sluice.dev/role` values (`serve` is an aggregated engine: `both`) and
llm-d's `llm-d.ai/role` values (prefill / decode / both).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlparse


@dataclass(frozen=True)
class Endpoint:
    pod: str                       # "host:port" of the HTTP server: the pod id everywhere
    url: str                       # "http://host:port"
    model: str | None              # served model name; None: read from its /v1/models
    pool: str = "default"
    namespace: str = "default"
    events: str | None = None      # KV-event PUB endpoint, e.g. "tcp://host:5557"
    replay: str | None = None      # KV-event replay ROUTER endpoint
    events_curve: bool | None = None  # CURVE on its event sockets; None: the picker's default
    role: str | None = None        # PREFILL, DECODE, BOTH or None (no role: as BOTH)


PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
_ROLE_VALUES = {PREFILL: PREFILL, DECODE: DECODE, BOTH: BOTH, "serve": BOTH}


def parse_role(value: str | None) -> str | None:
    """A role label's value as a role (PREFILL / DECODE / BOTH); None when absent or
    unknown (an unknown value must not take a pod out of the decode set)."""
    return _ROLE_VALUES.get((value or "").strip().lower())


OnChange = Callable[[list[Endpoint]], None]


class Discovery(Protocol):
    async def start(self, on_change: OnChange) -> None: ...

    async def stop(self) -> None: ...


def pod_address(host: str, port: int) -> str:
    """The `ip:port` that names a pod: what Envoy routes to (GIE endpoints are
    addresses, not names) and reports as the endpoint that served."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                                      [0][4][0])
        except OSError as err:
            raise ValueError(f"cannot resolve engine host {host!r}: {err}") from None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def parse_engine_spec(spec: str) -> Endpoint:
    """`URL[,events=tcp://h:p][,replay=tcp://h:p][,model=NAME][,pool=P][,role=R]`.

    Without `events`, the engine has no KV-event feed (kv_aware then knows only
    speculative entries for it). `role`: prefill, decode or both (module docstring)."""
    url, *opts = [s.strip() for s in spec.split(",")]
    if "://" not in url:
        url = "http://" + url
    parsed = urlparse(url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"engine URL needs host:port: {spec!r}")
    kv: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("events", "replay", "model", "pool", "role"):
            raise ValueError(f"bad engine option {opt!r} in {spec!r}")
        if key in ("events", "replay") and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{key}= needs a ZMQ address (tcp://host:port or ipc://path): "
                             f"{spec!r}")
        if key == "role" and value not in ROLES:
            raise ValueError(f"role= is one of {', '.join(ROLES)}: {spec!r}")
        kv[key] = value
    return Endpoint(pod=pod_address(parsed.hostname, parsed.port), url=url.rstrip("/"),
                    model=kv.get("model"), pool=kv.get("pool", "default"),
                    events=kv.get("events"), replay=kv.get("replay"), role=kv.get("role"))


class StaticDiscovery:
    def __init__(self, endpoints: list[Endpoint]) -> None:
        pods = [e.pod for e in endpoints]
        assert len(set(pods)) == len(pods), "duplicate engine"
        self.endpoints = list(endpoints)

    async def start(self, on_change: OnChange) -> None:
        on_change(list(self.endpoints))

    async def stop(self) -> None:
        return None
