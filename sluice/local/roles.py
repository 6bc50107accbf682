"""The engines of a local stack, by role: aggregated (`sluice up --engines N`: every engine
prefills and decodes its own requests) or disaggregated (`--prefill N --decode M`).

Disaggregated, each engine gets vLLM's `--kv-transfer-config` with our TCP connector:
prefill engines are `kv_producer`s (they prefill and hold the KV blocks until a decode
engine pulls them), decode engines `kv_consumer`s. Transfer sockets bind loopback on an
ephemeral port (`kv_port` 0: nothing to allocate; the port travels in the prefill
answer's `kv_transfer_params`). The picker learns each engine's role from its
`--engine ...,role=` spec, names a prefill engine in `x-prefiller-host-port` for long
prompts, and never sends a client to a prefill engine (`sluice.gateway.routing.pd`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PREFILL, DECODE = "prefill", "decode"  # the picker's role names (discovery.static)
KV_ROLES = {PREFILL: "kv_producer", DECODE: "kv_consumer"}


@dataclass(frozen=True)
class EngineRole:
    name: str                 # the process's name in the logs: engine-0, prefill-0, decode-1
    role: str | None          # PREFILL, DECODE, or None (aggregated)
    argv: tuple[str, ...] = ()  # the role's own engine flags

    @property
    def destination(self) -> bool:
        """Whether clients' requests may be sent to it (Envoy's known hosts)."""
        return self.role != PREFILL


def kv_transfer_config(role: str, engine_id: str) -> str:
    """`--kv-transfer-config` JSON of a local engine of `role` (PREFILL or DECODE)."""
    return json.dumps({"kv_connector": "SluiceConnector", "kv_role": KV_ROLES[role],
                       "kv_ip": "127.0.0.1", "kv_port": 0, "engine_id": engine_id})


def engine_roles(engines: int, prefill: int = 0, decode: int = 0) -> list[EngineRole]:
    """`engines` aggregated engines when `prefill` and `decode` are 0, else `prefill`
    producers then `decode` consumers (ValueError when only one of them is given)."""
    if not prefill and not decode:
        return [EngineRole(f"engine-{i}", None) for i in range(engines)]
    if prefill < 1 or decode < 1:
        raise ValueError("a disaggregated stack needs at least one prefill and one decode "
                         f"engine (got --prefill {prefill} --decode {decode})")
    return [EngineRole(f"{role}-{i}", role, ("--kv-transfer-config",
                                             kv_transfer_config(role, f"{role}-{i}")))
            for role, n in ((PREFILL, prefill), (DECODE, decode)) for i in range(n)]
