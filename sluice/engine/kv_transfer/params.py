"""`kv_transfer_params`: what the two legs of a disaggregated request tell each other.

vLLM's names and flow (NixlConnector):
- prefill leg, client -> prefill engine: `{"do_remote_decode": true}` (the other fields
  null). The engine prefills, samples one token, and holds the prompt's blocks.
- prefill engine -> client (the response's top-level `kv_transfer_params`):
  `{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": ...,
  "remote_block_ids": [...], "remote_host": ..., "remote_port": ...,
  "remote_request_id": ..., "tp_size": 1, "lora_name": ...}`.
- decode leg, client -> decode engine: the original request with those params. The
  decode engine pulls the blocks it does not hold and decodes.
`remote_request_id` names the held blocks on the prefill engine (vLLM relies on both
engines sharing the proxy's request id; an explicit id lets any proxy pass the params
through unchanged). `lora_name` is the LoRA adapter the prefill ran with (None: the base
model): the decode leg must name the same one, or its blocks would mix adapters. The
struct crosses to the engine core inside SamplingParams.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MAX_BLOCK_IDS = 1 << 20


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1
    lora_name: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError with a message naming the field, for a client's 400."""
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill "
                             "cannot both be true")
        if self.tp_size != 1:
            raise ValueError(f"kv_transfer_params.tp_size: this engine pulls from "
                             f"single-device engines only (tp_size 1), got {self.tp_size}")
        if not self.do_remote_prefill:
            return
        for name in ("remote_engine_id", "remote_host", "remote_request_id"):
            if not getattr(self, name):
                raise ValueError(f"kv_transfer_params.{name} is required with "
                                 f"do_remote_prefill (pass the prefill response's params)")
        if self.remote_port is None or not 0 < self.remote_port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port in [1, 65535] "
                             "with do_remote_prefill")
        ids = self.remote_block_ids
        if not ids or len(ids) > MAX_BLOCK_IDS or min(ids) < 0:
            raise ValueError("kv_transfer_params.remote_block_ids must be a non-empty list of "
                             "block ids with do_remote_prefill")

    def to_json(self) -> dict:
        out = asdict(self)
        if self.remote_block_ids is not None:
            out["remote_block_ids"] = list(self.remote_block_ids)
        return out
