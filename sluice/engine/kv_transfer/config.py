"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON, typed and frozen.

    {"kv_connector": "SluiceConnector", "kv_role": "kv_both",
     "kv_ip": "0.0.0.0", "kv_port": 14579, "engine_id": "prefill-0",
     "kv_connector_extra_config": {"advertise_host": "10.0.0.7", "hold_timeout_s": 480,
                                   "pull_timeout_s": 30, "curve_dir": "/keys/kv"}}

kv_role: kv_producer (prefills for others: holds blocks for a pull), kv_consumer (pulls
blocks and decodes), kv_both (either, per request: what vLLM's NixlConnector uses).
kv_ip / kv_port: where the transfer socket binds (port 0: an ephemeral port, tests).
Fields vLLM accepts that mean nothing for a TCP transport on one device (kv_buffer_device,
kv_buffer_size, kv_rank, kv_parallel_size) are accepted so vLLM command lines work; any
other key is an error naming it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Our TCP connector under its own name; "TcpConnector" is an alias. NIXL is the planned
# GPU plug-in (docs/engine.md): named here so its absence is a clear error.
CONNECTORS = ("SluiceConnector", "TcpConnector")
PLANNED = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1")
_IGNORED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
            "kv_load_failure_policy")
_EXTRA_KEYS = ("advertise_host", "hold_timeout_s", "pull_timeout_s", "curve_dir")
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port
DEFAULT_HOLD_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    advertise_host: str | None = None  # the host decode engines dial (default: kv_ip)
    hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S  # producer: free unpulled blocks after
    pull_timeout_s: float = 30.0  # consumer: give up on a pull (then prefill locally) after
    curve_dir: str | None = None  # ZMQ CURVE keys (python -m sluice.zmq_curve init DIR)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            planned = " (planned: a GPU transport behind the same interface, docs/engine.md)"
            raise ValueError(f"kv_connector {self.kv_connector!r} is not available"
                             f"{planned if self.kv_connector in PLANNED else ''}; "
                             f"available: {', '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}; got {self.kv_role!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be in [0, 65535]; got {self.kv_port}")
        if self.hold_timeout_s <= 0 or self.pull_timeout_s <= 0:
            raise ValueError("hold_timeout_s and pull_timeout_s must be positive")
        if not self.engine_id:
            raise ValueError("engine_id must not be empty")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse vLLM's JSON; ValueError or TypeError naming the offending key or value."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise TypeError("--kv-transfer-config must be a JSON object")
        raw = {k: v for k, v in raw.items() if k not in _IGNORED}
        extra = raw.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise TypeError("kv_connector_extra_config must be a JSON object")
        known = {"kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port"}
        unknown = sorted(set(raw) - known) + sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)}")
        for key in ("kv_connector", "kv_role"):
            if not isinstance(raw.get(key), str):
                raise TypeError(f"--kv-transfer-config needs {key!r} (a string)")
        if "kv_port" in raw and (not isinstance(raw["kv_port"], int)
                                 or isinstance(raw["kv_port"], bool)):
            raise TypeError("kv_port must be an integer")
        for key in ("hold_timeout_s", "pull_timeout_s"):
            if key in extra and not isinstance(extra[key], (int, float)):
                raise TypeError(f"kv_connector_extra_config.{key} must be a number")
        if raw.get("engine_id") is None:
            raw.pop("engine_id", None)
        return cls(**raw, **extra)
