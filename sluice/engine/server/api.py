"""The engine's OpenAI-compatible HTTP API (FastAPI).

Every error is OpenAI-shaped JSON (`errors.py`), and no client input gets a
5xx: 400 for a body that is not strict JSON (`json_body.py`), has the wrong
types or values (`protocol.py`), text the tokenizer or chat template refuses,
token ids outside the vocabulary, or a prompt that does not fit the context
(`validation.py`); 404 for an unknown model or path, 405 for a wrong method,
413 for a body over --max-request-body-bytes (`body_limit.py`), 429 with
Retry-After when the waiting queue has no room for all of a request's n x
prompts sub-requests, 503 when the engine is down. A client that disconnects
(streaming or not) aborts its requests at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sluice.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from sluice.engine.server import formatting as fmt
from sluice.engine.server.auth import ApiKeyMiddleware
from sluice.engine.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from sluice.engine.server.errors import RequestError, error_response, install_error_handlers
from sluice.engine.server.json_body import StrictJSONRoute
from sluice.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from sluice.engine.server.validation import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    Limits,
    chat_prompt,
    check_context,
    check_queue_room,
    check_text_size,
    completion_prompts,
    tokenize,
)
from sluice.openai_error import error_body


def build_app(engine: AsyncEngine, tokenizer, model_name: str,
              sampling_defaults: dict | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              api_key: str | None = None) -> FastAPI:
    """`sampling_defaults`: per-model defaults for fields a request leaves out."""
    app = FastAPI(title="Sluice engine")
    app.router.route_class = StrictJSONRoute  # before any route: each one parses strictly
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # (outermost: checked first)
    llm = engine.engine
    max_model_len = llm.max_model_len
    limits = Limits(max_model_len, llm.model.config.vocab_size, max_prompts_per_request)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(f"engine stopped: {engine.error!r}", 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "sluice",
            "root": llm.config.model, "max_model_len": max_model_len}]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's endpoint: empty the prefix cache (benchmarks start equal); 409 while busy."""
        if await engine.reset_prefix_cache():
            return Response(status_code=200)
        return error_response("requests are running; the prefix cache was not reset", 409)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(llm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model not in (None, model_name):
            raise RequestError(f"The model `{body.model}` does not exist.", "model", 404)

    def default_max_tokens(prompt_len: int) -> int:
        return max(1, max_model_len - prompt_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body)
        prompts = await completion_prompts(body.prompt, tokenizer, limits)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await _serve(raw, body, prompts, rid, "text_completion", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer / chat template", "messages")

        def encode() -> list[int]:
            return tokenizer.encode_chat(body.message_dicts(), body.add_generation_prompt,
                                         body.tools, **(body.chat_template_kwargs or {}))

        rendered = [m.model_dump() for m in body.messages], body.tools, body.chat_template_kwargs
        ids = await chat_prompt(rendered, encode, limits)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await _serve(raw, body, [ids], rid, "chat.completion", chat=True)

    @app.post("/tokenize")
    async def tokenize_prompt(body: TokenizeChatRequest | TokenizeCompletionRequest):
        """vLLM's endpoint, same request and answer: the ids a completion would get
        (the endpoint picker tokenizes through it when it has no tokenizer)."""
        check_model(body)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", None)
        if isinstance(body, TokenizeChatRequest):
            def encode() -> list[int]:
                return tokenizer.encode_chat(body.message_dicts(), body.add_generation_prompt,
                                             body.tools, **(body.chat_template_kwargs or {}))

            rendered = ([m.model_dump() for m in body.messages], body.tools,
                        body.chat_template_kwargs)
            ids = await chat_prompt(rendered, encode, limits)
        else:
            text, special = body.prompt, body.add_special_tokens
            check_text_size(len(text), limits, "prompt")
            ids = await tokenize(lambda: tokenizer.encode(text, add_special_tokens=special),
                                 len(text), "prompt")
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": None}

    async def _serve(raw: Request, body, prompts: list[list[int]], rid: str, obj: str,
                     chat: bool):
        if chat:
            n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            n_logprobs = body.logprobs
        max_tokens, max_tokens_param = body.requested_max_tokens()
        for ids in prompts:
            check_context(len(ids), max_tokens, max_model_len, "messages" if chat else "prompt",
                          max_tokens_param)
        # All n x prompts sub-requests enter the waiting queue: refuse them together, up
        # front, rather than queue some and abort them when a later one finds it full.
        check_queue_room(len(prompts) * body.n, engine.waiting_room(),
                         llm.config.scheduler.max_waiting_requests)
        streams: list[AsyncIterator] = []
        try:
            # Choice i is sample i % n of prompt i // n (OpenAI's order for n > 1).
            for i in range(len(prompts) * body.n):
                ids = prompts[i // body.n]
                params = body.sampling_params(default_max_tokens(len(ids)), n_logprobs,
                                              i % body.n, sampling_defaults)
                gen = engine.generate(f"{rid}-{i}", ids, params, body.cache_salt)
                streams.append(_prime(gen))
                await streams[-1].__anext__()  # surfaces validation / overload errors now
        except (ValueError, EngineOverloadedError, EngineDeadError) as exc:
            for s in streams:
                await s.aclose()
            if isinstance(exc, EngineOverloadedError):
                return error_response(f"server is overloaded: {exc}", 429, retry_after=1)
            if isinstance(exc, EngineDeadError):
                return error_response(str(exc), 503)
            return error_response(str(exc), 400)
        choices = [fmt.ChoiceState(i) for i in range(len(streams))]
        if body.stream:
            events = _stream_events(streams, choices, body, rid, obj, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        work = asyncio.ensure_future(_collect(streams, choices))
        if not await _finished_before_disconnect(raw, work):
            return Response(status_code=499)
        return _full_response(choices, rid, obj, chat)

    def _full_response(choices, rid, obj, chat) -> dict:
        out = fmt.envelope(rid, obj, model_name)
        items = []
        for c in choices:
            item = {"index": c.index, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
            if chat:
                item["message"] = {"role": "assistant", "content": c.text}
                item["logprobs"] = fmt.chat_logprobs(tokenizer, c.logprobs) if c.logprobs else None
            else:
                item["text"] = c.text
                item["logprobs"] = (fmt.completion_logprobs(tokenizer, c.logprobs)
                                    if c.logprobs else None)
            items.append(item)
        return {**out, "choices": items, "usage": fmt.usage(choices)}

    async def _stream_events(streams, choices, body, rid, obj, chat):
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        head = fmt.envelope(rid, chunk_obj, model_name)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        try:
            if chat:
                for c in choices:
                    yield fmt.sse({**head, "choices": [{"index": c.index, "logprobs": None,
                        "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            async for i, out in _merge(streams):
                c = choices[i]
                c.add(out)
                if not out.new_text and not out.finished and not out.new_logprobs:
                    continue
                item = {"index": i, "finish_reason": out.finish_reason if out.finished else None}
                if out.finished:
                    item["stop_reason"] = out.stop_reason
                lps = out.new_logprobs or []
                if chat:
                    some = out.new_text or not out.finished
                    item["delta"] = {"content": out.new_text} if some else {}
                    item["logprobs"] = fmt.chat_logprobs(tokenizer, lps) if lps else None
                else:
                    item["text"] = out.new_text
                    item["logprobs"] = fmt.completion_logprobs(tokenizer, lps) if lps else None
                yield fmt.sse({**head, "choices": [item]})
            if include_usage:
                yield fmt.sse({**head, "choices": [], "usage": fmt.usage(choices)})
        except EngineDeadError as exc:
            yield fmt.sse(error_body(503, str(exc)))
        finally:
            for s in streams:
                await s.aclose()
        yield fmt.sse("[DONE]")

    return app


async def _prime(gen: AsyncIterator):
    """Wrap a generate() stream so its first await happens before the response starts."""
    first = await gen.__anext__()
    yield None  # primed: errors from the first step were raised above
    try:
        yield first
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


async def _merge(streams: list[AsyncIterator]):
    """Interleave several output streams as (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        # Wait for the pumps to stop: the caller closes the streams next, and closing
        # one a pump is still iterating raises "aclose(): ... already running" (found
        # by schemathesis: a client gone from a streamed n > 1 request).
        await asyncio.wait(tasks)


async def _collect(streams, choices) -> None:
    async for i, out in _merge(streams):
        choices[i].add(out)


async def _finished_before_disconnect(raw: Request, work: asyncio.Future) -> bool:
    """Wait for `work`; if the client goes away first, cancel it (aborting the requests)."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=0.1)
        if done:
            work.result()
            return True
        if await raw.is_disconnected():
            work.cancel()
            return False
