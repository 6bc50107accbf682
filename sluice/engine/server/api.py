"""The engine's OpenAI-compatible HTTP API (FastAPI).

Every error is OpenAI-shaped JSON (`errors.py`), and no client input gets a
5xx: 400 for a body that is not strict JSON (`json_body.py`), has the wrong
types or values (`protocol.py`), text the tokenizer or chat template refuses,
token ids outside the vocabulary, or a prompt that does not fit the context
(`validation.py`), a field the server does not implement (`unknown_fields.py`),
a constraint that does not compile (`structured.py`) or inconsistent tools
(`tools.py`); 404 for an unknown model or path, 405 for a wrong method,
413 for a body over --max-request-body-bytes (`body_limit.py`), 429 with
Retry-After when the waiting queue has no room for all of a request's n x
prompts sub-requests, 503 when the engine is down. A client that disconnects
(streaming or not) aborts its requests at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from sluice.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from sluice.engine.llm_engine import UnknownModelError
from sluice.engine.server import formatting as fmt
from sluice.engine.server.auth import ApiKeyMiddleware
from sluice.engine.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyLimitMiddleware
from sluice.engine.server.chat_render import check_chat_flags, encode_chat_request
from sluice.engine.server.disagg import DisaggLegs
from sluice.engine.server.errors import RequestError, error_response, install_error_handlers
from sluice.engine.server.json_body import StrictJSONRoute
from sluice.engine.server.lora_routes import adapter_cards, add_lora_routes
from sluice.engine.server.priority import request_priority
from sluice.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from sluice.engine.server.request_params import derived_fields
from sluice.engine.server.responses import ResponsePlan, full_response, stream_events
from sluice.engine.server.streams import collect, finished_before_disconnect, prime
from sluice.engine.server.structured import compile_constraint, requested_constraint
from sluice.engine.server.tokenize_routes import add_tokenize_routes
from sluice.engine.server.tools import tool_setup
from sluice.engine.server.unknown_fields import UnknownFields
from sluice.engine.server.validation import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    Limits,
    chat_prompt,
    check_context,
    check_queue_room,
    completion_prompts,
)
from sluice.engine.structured_output.manager import StructuredOutputManager


def build_app(engine: AsyncEngine, tokenizer, model_name: str,
              sampling_defaults: dict | None = None, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              api_key: str | None = None, tool_call_parser: str | None = None,
              allow_unknown_fields: bool = False) -> FastAPI:
    """`sampling_defaults`: per-model defaults for fields a request leaves out;
    `tool_call_parser`: the parser of `tool_choice: auto` (None: auto is a 400);
    `allow_unknown_fields`: ignore (and log) fields the server does not implement."""
    app = FastAPI(title="Sluice engine")
    app.router.route_class = StrictJSONRoute  # before any route: each one parses strictly
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key)  # (outermost: checked first)
    info = engine.info
    max_model_len = info.max_model_len
    limits = Limits(max_model_len, info.vocab_size, max_prompts_per_request)
    unknown = UnknownFields(allow_unknown_fields)
    legs = DisaggLegs(getattr(info, "kv_role", None), getattr(info, "block_size", 16),
                      model_name)
    # Compiles constraints to validate them (a 400 before queueing); the engine core
    # compiles its own copy, from its own cache, when it adds the request.
    grammars = StructuredOutputManager(
        tokenizer, info.vocab_size, frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset())

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return error_response(f"engine stopped: {engine.error!r}", 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "sluice",
            "root": info.model, "max_model_len": max_model_len},
            *adapter_cards(engine, model_name, max_model_len)]}

    add_lora_routes(app, engine, model_name)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's endpoint: empty the prefix cache (benchmarks start equal); 409 while busy."""
        if await engine.reset_prefix_cache():
            return Response(status_code=200)
        return error_response("requests are running; the prefix cache was not reset", 409)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics_text() + legs.metrics_text(),
                        media_type=CONTENT_TYPE_LATEST)

    def check_model(body) -> None:
        if body.model not in (None, model_name, *engine.lora_modules()):
            raise RequestError(f"The model `{body.model}` does not exist.", "model", 404)

    def default_max_tokens(prompt_len: int) -> int:
        return max(1, max_model_len - prompt_len)

    def check_common(body) -> None:
        check_model(body)
        unknown.check(body)
        if body.stream and body.prompt_logprobs is not None:
            raise RequestError("`prompt_logprobs` are not available when `stream=True`.",
                               "prompt_logprobs")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_common(body)
        if body.max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt "
                               "alone)", "max_tokens")
        constraint, param = requested_constraint(body.response_format, body.structured_outputs)
        prompts = await completion_prompts(body.prompt, tokenizer, limits,
                                           body.add_special_tokens)
        await compile_constraint(grammars, constraint, param)
        echo_only = body.echo and body.max_tokens == 0
        # vLLM: echo with logprobs returns the prompt's logprobs too.
        prompt_lp = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_lp is None:
            prompt_lp = body.logprobs
        derived = derived_fields(body, tokenizer, info.vocab_size, constraint,
                                 prompt_logprobs=prompt_lp)
        if echo_only:
            derived["max_tokens"] = 1  # one token is generated, and not shown
        echo = None
        if body.echo:
            echo = list(zip(_prompt_texts(body.prompt, prompts, tokenizer), prompts))
        plan = ResponsePlan(f"cmpl-{uuid.uuid4().hex}", body.model or model_name, chat=False, n=body.n,
                            logprobs=body.logprobs is not None,
                            prompt_logprobs=body.prompt_logprobs is not None, echo=echo,
                            hide_output=echo_only, **_usage_flags(body))
        return await _serve(raw, body, prompts, plan, body.logprobs, derived, "prompt")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_common(body)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer / chat template", "messages")
        check_chat_flags(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true",
                               "top_logprobs")
        tools = tool_setup(body, tool_call_parser)
        constraint, param = requested_constraint(body.response_format, body.structured_outputs,
                                                 tools.schema)
        await compile_constraint(grammars, constraint, "tools" if param == "tool_choice"
                                 else param)
        rendered = ([m.model_dump() for m in body.messages], body.tool_dicts(),
                    body.chat_template_kwargs)
        ids = await chat_prompt(rendered, lambda: encode_chat_request(tokenizer, body), limits)
        derived = derived_fields(body, tokenizer, info.vocab_size, constraint,
                                 skip_special_tokens=tools.skip_special_tokens)
        plan = ResponsePlan(f"chatcmpl-{uuid.uuid4().hex}", body.model or model_name, chat=True, n=body.n,
                            tools=tools, logprobs=body.logprobs,
                            prompt_logprobs=body.prompt_logprobs is not None,
                            **_usage_flags(body))
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(raw, body, [ids], plan, n_logprobs, derived, "messages")

    def check_tokenize(body) -> None:
        check_model(body)
        unknown.check(body)

    add_tokenize_routes(app, tokenizer, limits, check_tokenize)

    async def _serve(raw: Request, body, prompts: list[list[int]], plan: ResponsePlan,
                     n_logprobs: int | None, derived: dict[str, Any], prompt_param: str):
        priority = request_priority(raw.headers, body.priority, info.scheduling_policy)
        lora = body.model if body.model not in (None, model_name) else None  # an adapter
        max_tokens, max_tokens_param = body.requested_max_tokens()
        for ids in prompts:
            check_context(len(ids), max_tokens, max_model_len, prompt_param, max_tokens_param)
        # All n x prompts sub-requests enter the waiting queue: refuse them together, up
        # front, rather than queue some and abort them when a later one finds it full.
        check_queue_room(len(prompts) * body.n, engine.waiting_room(),
                         info.max_waiting_requests)
        # Disaggregated prefill/decode (disagg.py): after the checks above, so a request
        # refused here never leaves blocks held on a prefill engine.
        derived = await legs.prepare(raw, body, prompts, derived)
        salt = body.cache_salt
        if derived.get("prompt_logprobs", body.prompt_logprobs) is not None:
            # Every prompt token's logits are needed: never read the prefix cache.
            salt = f"{salt or ''}|prompt-logprobs:{plan.rid}"
        streams: list[AsyncIterator] = []
        try:
            # Choice i is sample i % n of prompt i // n (OpenAI's order for n > 1).
            for i in range(len(prompts) * body.n):
                ids = prompts[i // body.n]
                params = body.sampling_params(default_max_tokens(len(ids)), n_logprobs,
                                              i % body.n, sampling_defaults, **derived)
                gen = engine.generate(f"{plan.rid}-{i}", ids, params, salt, priority, lora)
                streams.append(prime(gen))
                await streams[-1].__anext__()  # surfaces validation / overload errors now
        except (ValueError, EngineOverloadedError, EngineDeadError) as exc:
            for s in streams:
                await s.aclose()
            if isinstance(exc, UnknownModelError):  # (unloaded since check_model)
                return error_response(str(exc), 404, "model")
            if isinstance(exc, EngineOverloadedError):
                return error_response(f"server is overloaded: {exc}", 429, retry_after=1)
            if isinstance(exc, EngineDeadError):
                return error_response(str(exc), 503)
            return error_response(str(exc), 400)
        choices = [fmt.ChoiceState(i) for i in range(len(streams))]
        for c in choices:
            c.num_prompt_tokens = len(prompts[c.index // body.n])
        if body.stream:
            events = stream_events(plan, streams, choices, tokenizer)
            return StreamingResponse(events, media_type="text/event-stream")
        work = asyncio.ensure_future(collect(streams, choices))
        if not await finished_before_disconnect(raw, work):
            return Response(status_code=499)
        return full_response(plan, choices, tokenizer)

    return app


def _usage_flags(body) -> dict[str, bool]:
    opts = body.stream_options
    return {"include_usage": bool(body.stream and opts and opts.include_usage),
            "continuous_usage": bool(opts and opts.continuous_usage_stats)}


def _prompt_texts(prompt: str | list, prompts: list[list[int]], tokenizer) -> list[str]:
    """Each prompt's text for echo: as sent, or its token ids decoded."""
    items: list = [prompt] if isinstance(prompt, str) else list(prompt)
    if all(isinstance(x, int) for x in items):
        items = [items]
    return [x if isinstance(x, str) else
            (tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else "")
            for x, ids in zip(items, prompts)]
