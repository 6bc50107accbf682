"""Test helpers (no tests here): engines' runtime LoRA endpoints as vLLM serves them
(`GET /v1/models`, `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, behind
the engine key), many engines behind one loopback server told apart by the Host header
(each pod's `<ip>:8000`), and `LoopbackTransport`, which sends the operator's requests
for any pod there."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def _error(status: int, message: str) -> JSONResponse:
    """vLLM's error body."""
    return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                   "param": None, "code": status}}, status_code=status)


class LoraEngines:
    def __init__(self, base: str = "base", api_key: str | None = None) -> None:
        self.base, self.api_key = base, api_key
        self.adapters: dict[str, dict[str, str]] = {}  # host -> adapter -> path
        self.failing: set[str] = set()  # hosts whose loads answer 400
        self.hanging: set[str] = set()  # hosts whose loads answer after 5 s
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (host, endpoint, body)
        self.app = self._app()

    def serving(self, host: str) -> dict[str, str]:
        return dict(self.adapters.get(host, {}))

    def _app(self) -> FastAPI:
        app = FastAPI()

        def denied(request: Request) -> JSONResponse | None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return _error(401, "Incorrect or missing API key")
            return None

        @app.get("/v1/models")
        async def models(request: Request):
            if (no := denied(request)) is not None:
                return no
            host = request.headers["host"]
            cards = [{"id": self.base, "object": "model", "root": "/models/base",
                      "parent": None}]
            cards += [{"id": name, "object": "model", "root": path, "parent": self.base}
                      for name, path in self.serving(host).items()]
            return {"object": "list", "data": cards}

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request):
            if (no := denied(request)) is not None:
                return no
            host, body = request.headers["host"], await request.json()
            self.calls.append((host, "load", body))
            name = body["lora_name"]
            if host in self.hanging:
                await asyncio.sleep(5)
            if host in self.failing:
                return _error(400, f"Loading lora {name} failed: No adapter found for "
                                   f"{body['lora_path']}")
            if name in self.adapters.setdefault(host, {}):
                return _error(400, f"The lora adapter '{name}' has already been loaded.")
            self.adapters[host][name] = body["lora_path"]
            return JSONResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request):
            if (no := denied(request)) is not None:
                return no
            host, body = request.headers["host"], await request.json()
            self.calls.append((host, "unload", body))
            if self.adapters.get(host, {}).pop(body["lora_name"], None) is None:
                return _error(404, f"The lora adapter '{body['lora_name']}' cannot be found.")
            return JSONResponse(f"Success: LoRA adapter '{body['lora_name']}' removed.")

        return app


class LoopbackTransport(httpx.AsyncBaseTransport):
    """Every request goes to `url`'s host and port instead; its Host header still names the
    pod it was for."""

    def __init__(self, url: str) -> None:
        self.target = httpx.URL(url)
        self._inner: httpx.AsyncHTTPTransport | None = None  # made in the loop that uses it

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            self._inner = httpx.AsyncHTTPTransport()
        request.url = request.url.copy_with(host=self.target.host, port=self.target.port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()
