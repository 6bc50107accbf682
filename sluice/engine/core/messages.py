"""Messages between the API process and the engine core (msgpack, typed with msgspec).

Commands go API -> core, events core -> API; each is a tagged struct so one decoder
takes the whole union. SamplingParams and RequestOutput cross as their own dataclasses:
msgspec rebuilds them from their type hints (tuples stay tuples) and runs
SamplingParams' validation again on arrival. Decoding builds only these types, never
an arbitrary object, unlike pickle.
"""

from __future__ import annotations

import msgspec

from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams


class EngineInfo(msgspec.Struct, frozen=True):
    """What the API layer needs to know about the engine behind it."""

    model: str
    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_waiting_requests: int
    kv_role: str | None = None  # --kv-transfer-config's kv_role (None: no KV transfer)
    block_size: int = 16
    scheduling_policy: str = "fcfs"
    max_loras: int = 0  # --max-loras (0: LoRA off)
    loras: dict[str, str] = msgspec.field(default_factory=dict)  # adapter name -> path


# -- API process -> core ------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    priority: int = 0
    lora_name: str | None = None


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset", array_like=True):
    call_id: int


class LoadLoRA(msgspec.Struct, tag="load_lora", array_like=True):
    """Register an adapter (read off the core's loop); the Reply carries the error, if any."""

    call_id: int
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag="unload_lora", array_like=True):
    call_id: int
    name: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = AddRequest | Abort | ResetPrefixCache | LoadLoRA | UnloadLoRA | Shutdown


# -- core -> API process ------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class Added(msgspec.Struct, tag="added", array_like=True):
    """The answer to AddRequest: error is None, or the engine's validation message."""

    request_id: str
    error: str | None = None
    prompt_too_long: bool = False
    unknown_model: bool = False


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's outputs, and how many requests the scheduler runs after it. A step that
    finishes a request or changes the running or waiting count carries the metrics too:
    a client that reads /metrics after its answer sees the request counted."""

    outputs: list[RequestOutput]
    num_running: int
    metrics: bytes | None = None


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    value: bool
    error: str | None = None


class Metrics(msgspec.Struct, tag="metrics", array_like=True):
    """The core's Prometheus exposition, pushed at most every METRICS_INTERVAL_S."""

    text: bytes


class Dead(msgspec.Struct, tag="dead", array_like=True):
    reason: str


Event = Ready | Added | Outputs | Reply | Metrics | Dead

encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
event_decoder = msgspec.msgpack.Decoder(Event)
