"""Test helpers (no tests here): a small scripted OpenAI-compatible engine (FastAPI), whose
failure modes tests choose, and a server that runs any ASGI app in a thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Self

import uvicorn
from engine_server import EngineProcess, free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class ThreadServer:
    """An ASGI app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def fake_engine(mode, state):
    """mode: ok | error500 (its /health too) | poisoned (500 to the prompt "poison",
    healthy) | busy429 | die_midstream | slow | stall (answers after 5 s) | prefill
    (answers after 1.5 s)."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if mode != "error500" else 500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.get("model", "m"), "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return StreamingResponse(iter([b"vllm:num_requests_waiting{model_name=\"m\"} 0\n"]))

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        body = await request.json()
        state["calls"] = state.get("calls", 0) + 1
        state["headers"] = dict(request.headers)  # (the last request's)
        state["body"] = body
        if mode == "error500" or mode == "poisoned" and body.get("prompt") == "poison":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if mode == "busy429":
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                                headers={"retry-after": "1"})
        if mode in ("stall", "prefill"):
            await asyncio.sleep(5 if mode == "stall" else 1.5)
        if not body.get("stream"):
            return {"id": "x", "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}]}

        async def gen():
            try:
                for i in range(50 if mode == "slow" else 3):
                    chunk = {"id": "x", "object": "text_completion",
                             "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    await asyncio.sleep(0.3 if mode in ("slow", "ok") else 0.05)
                    if mode == "die_midstream" and i == 1:
                        raise RuntimeError("engine died")
                yield b"data: [DONE]\n\n"
            finally:
                state["closed_at"] = time.time()

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def engine_with_events(model_dir: str, name: str, *extra: str) -> tuple[EngineProcess, str]:
    """Start an engine publishing KV events; returns (process, picker --engine spec)."""
    ev, rp = free_port(), free_port()
    proc = EngineProcess("--model", model_dir, "--served-model-name", name,
                         "--num-kv-blocks", "512", "--max-model-len", "1024",
                         "--kv-events-endpoint", f"tcp://*:{ev}",  # "*": bind (vLLM rule)
                         "--kv-events-replay-endpoint", f"tcp://*:{rp}", *extra)
    spec = f"{proc.url},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp},model={name}"
    return proc, spec
