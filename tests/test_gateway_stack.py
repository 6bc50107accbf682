"""Test helpers (no tests here): an app (the gateway's HTTP app, or a FastAPI fake engine)
served in a thread; engines with KV events. Named test_gateway_* to stay within the gateway
test files."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from engine_server import EngineProcess, free_port

from sluice.gateway.http_server import App, HttpServer


class ThreadServer:
    """An app on a free loopback port, in a thread: the gateway's `App` as `sluice
    gateway` serves it, anything else (ASGI) with uvicorn."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.native = isinstance(app, App)
        if self.native:
            self.http = HttpServer(app, grace_s=1.0)
            self.loop = asyncio.new_event_loop()
            self.started = threading.Event()
            self.thread = threading.Thread(target=self._run_native, daemon=True)
        else:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                        log_level="error", lifespan="on"))
            self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _run_native(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.http.start("127.0.0.1", self.port))
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.http.stop())
        self.loop.close()

    def _is_started(self) -> bool:
        return self.started.is_set() if self.native else self.server.started

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self._is_started():
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.native:
            self.loop.call_soon_threadsafe(self.loop.stop)
        else:
            self.server.should_exit = True
        self.thread.join(15)


def engine_with_events(model_dir: str, name: str, *extra: str) -> tuple[EngineProcess, str]:
    """Start an engine publishing KV events; returns (process, gateway --engine spec)."""
    ev, rp = free_port(), free_port()
    proc = EngineProcess("--model", model_dir, "--served-model-name", name,
                         "--num-kv-blocks", "512", "--max-model-len", "1024",
                         "--kv-events-endpoint", f"tcp://*:{ev}",  # "*": bind (vLLM rule)
                         "--kv-events-replay-endpoint", f"tcp://*:{rp}", *extra)
    spec = f"{proc.url},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp},model={name}"
    return proc, spec
