"""Test helpers (no tests here): stand-ins for vLLM in `sluice bench engine --compare vllm`.

- `streaming_app(delay_s, state)`: an OpenAI server whose streaming /v1/completions
  sends `max_tokens` chunks, `delay_s` apart, then a usage chunk (prompt tokens =
  words), recording every request body in `state["bodies"]`.
- `install(root)`: writes a package `vllm` under `root` (put it on PYTHONPATH) whose
  `vllm.entrypoints.openai.api_server` serves `streaming_app` like vLLM's server
  (and forks a sleeping "engine core", as vLLM does), and whose `LLM` /
  `SamplingParams` run the offline script. Both write what they were given to
  $FAKE_VLLM_RECORD (JSON); FAKE_VLLM_FAIL=1 makes the server exit at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

HERE = Path(__file__).parent


def streaming_app(delay_s: float, state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.get("model", "m"), "object": "model"}]}

    @app.post("/v1/completions")
    async def complete(request: Request) -> StreamingResponse:
        body = await request.json()
        state.setdefault("bodies", []).append(body)

        async def gen():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(delay_s)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            usage = {"prompt_tokens": len(body["prompt"].split()),
                     "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def _record(entry: dict) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if path:
        Path(path).write_text(json.dumps(entry))


def serve_like_vllm(argv: list[str]) -> None:
    """What the fake `python -m vllm.entrypoints.openai.api_server` runs."""
    import uvicorn

    if os.environ.get("FAKE_VLLM_FAIL"):
        print("fake vllm: boom, no model here", flush=True)
        sys.exit(3)
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--served-model-name")
    known, _ = p.parse_known_args(argv)
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    _record({"argv": argv, "pid": os.getpid(), "core_pid": core.pid,
             "kv_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
             "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
             "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")})
    app = streaming_app(0.001, {"model": known.served_model_name})
    uvicorn.run(app, host="127.0.0.1", port=known.port, log_level="error")


class SamplingParams(SimpleNamespace):
    def __init__(self, max_tokens: int = 16, temperature: float = 1.0, ignore_eos: bool = False,
                 seed: int | None = None) -> None:
        super().__init__(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                         seed=seed)


class LLM:
    """The offline API: generate answers each prompt with max_tokens tokens, 0.2 s a call."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[dict] = []

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        time.sleep(0.2)
        self.calls.append({"prompts": [p["prompt_token_ids"] for p in prompts],
                           "params": [vars(s) for s in params]})
        _record({"llm_kwargs": self.kwargs, "calls": self.calls,
                 "kv_space": os.environ.get("VLLM_CPU_KVCACHE_SPACE")})
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=[SimpleNamespace(token_ids=[7] * s.max_tokens)])
                for p, s in zip(prompts, params)]


def install(root: Path) -> Path:
    """Write the fake `vllm` package under `root`; returns `root`."""
    pkg = root / "vllm"
    (pkg / "entrypoints" / "openai").mkdir(parents=True)
    head = f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
    (pkg / "__init__.py").write_text(head + "from fake_vllm import LLM, SamplingParams\n")
    (pkg / "entrypoints" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "__init__.py").write_text("")
    (pkg / "entrypoints" / "openai" / "api_server.py").write_text(
        head + "from fake_vllm import serve_like_vllm\nserve_like_vllm(sys.argv[1:])\n")
    return root
