"""vLLM's runtime LoRA endpoints, `POST /v1/load_lora_adapter` {lora_name, lora_path} and
`POST /v1/unload_lora_adapter` {lora_name}, and the adapters' entries in /v1/models.

Both endpoints are admin surface (auth.py): served only to holders of the engine's key. A
load answers once the adapter is read and registered (off the engine's step loop), 400
naming what is wrong with it otherwise; an unload of an unknown name is a 404. An
unloaded adapter's running requests finish with it; new ones get 404.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from sluice.engine.lora.config import check_lora_name
from sluice.engine.server.errors import RequestError

_STRICT = ConfigDict(strict=True, extra="forbid")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field, unused: names identify adapters


def add_lora_routes(app: FastAPI, engine, model_name: str) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name = body.lora_name
        try:
            check_lora_name(name)
        except ValueError as exc:
            raise RequestError(str(exc), "lora_name") from None
        if name == model_name:
            raise RequestError(f"'{name}' is the base model's name", "lora_name")
        error = await engine.load_lora_adapter(name, body.lora_path)
        if error is not None:
            raise RequestError(error, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if not await engine.unload_lora_adapter(body.lora_name):
            raise RequestError(f"The lora adapter '{body.lora_name}' cannot be found.",
                               "lora_name", 404)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def adapter_cards(engine, model_name: str, max_model_len: int) -> list[dict]:
    """/v1/models entries of the registered adapters (vLLM's: `parent` names the base)."""
    return [{"id": name, "object": "model", "created": 0, "owned_by": "sluice", "root": path,
             "parent": model_name, "max_model_len": max_model_len}
            for name, path in engine.lora_modules().items()]
