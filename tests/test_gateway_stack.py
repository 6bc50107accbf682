"""Test helpers (no tests here): a gateway app served by uvicorn in a thread; engines with KV
events. Named test_gateway_* to stay within the gateway test files."""

from __future__ import annotations

import threading
import time

import uvicorn
from engine_server import EngineProcess, free_port


class ThreadServer:
    """uvicorn on a free loopback port, in a thread (for in-process gateways)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
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


def engine_with_events(model_dir: str, name: str, *extra: str) -> tuple[EngineProcess, str]:
    """Start an engine publishing KV events; returns (process, gateway --engine spec)."""
    ev, rp = free_port(), free_port()
    proc = EngineProcess("--model", model_dir, "--served-model-name", name,
                         "--num-kv-blocks", "512", "--max-model-len", "1024",
                         "--kv-events-endpoint", f"tcp://*:{ev}",  # "*": bind (vLLM rule)
                         "--kv-events-replay-endpoint", f"tcp://*:{rp}", *extra)
    spec = f"{proc.url},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rp},model={name}"
    return proc, spec
