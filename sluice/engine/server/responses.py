"""A request's engine outputs as its OpenAI answer: one JSON body, or server-sent events.

`ResponsePlan` holds everything about the request that shapes the answer; the
streamed and the full answer read the same plan and the same per-choice state, and
a chat choice's content and tool calls come from the same `ToolCallStream` in both
(`tool_calls.py`), so the two forms agree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from sluice.engine.async_engine import EngineDeadError
from sluice.engine.server import formatting as fmt
from sluice.engine.server.streams import merge
from sluice.engine.server.tool_calls import ChatDelta, ToolCallStream
from sluice.engine.server.tool_calls import merge as merge_deltas
from sluice.engine.server.tools import ToolSetup
from sluice.openai_error import error_body


@dataclass(frozen=True)
class ResponsePlan:
    rid: str
    model: str
    chat: bool
    n: int = 1  # choices per prompt: choice i belongs to prompt i // n
    tools: ToolSetup | None = None  # chat
    logprobs: bool = False  # report the sampled tokens' logprobs
    prompt_logprobs: bool = False  # report vLLM's prompt_logprobs
    echo: list[tuple[str, list[int]]] | None = None  # completions: (text, ids) per prompt
    hide_output: bool = False  # echo with max_tokens 0: the prompt only
    include_usage: bool = False
    continuous_usage: bool = False

    @property
    def has_tools(self) -> bool:
        return self.tools is not None and self.tools.mode != "plain"


def full_response(plan: ResponsePlan, choices: list[fmt.ChoiceState], tokenizer) -> dict:
    out = fmt.envelope(plan.rid, "chat.completion" if plan.chat else "text_completion",
                       plan.model)
    items = []
    for c in choices:
        item = {"index": c.index, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
        if plan.chat:
            message: dict = {"role": "assistant", "content": c.text}
            if plan.has_tools:
                assert plan.tools is not None
                stream = plan.tools.stream()
                content, calls = merge_deltas([stream.feed(c.text), stream.finish()])
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                item["finish_reason"] = plan.tools.finish_reason(stream, c.finish_reason)
            item["message"] = message
            item["logprobs"] = (fmt.chat_logprobs(tokenizer, c.logprobs)
                                if plan.logprobs else None)
        else:
            item.update(_completion_part(plan, c, c.text, c.logprobs, True, tokenizer))
            if plan.prompt_logprobs:
                item["prompt_logprobs"] = fmt.prompt_logprobs(tokenizer, c.prompt_logprobs)
        items.append(item)
    body = {**out, "choices": items, "usage": fmt.usage(choices)}
    if choices and choices[0].kv_transfer_params is not None:  # vLLM's top-level field
        body["kv_transfer_params"] = choices[0].kv_transfer_params
    if plan.chat and plan.prompt_logprobs:
        body["prompt_logprobs"] = fmt.prompt_logprobs(tokenizer, choices[0].prompt_logprobs)
    return body


async def stream_events(plan: ResponsePlan, streams: list[AsyncIterator],
                        choices: list[fmt.ChoiceState], tokenizer):
    """The answer as server-sent events, ending with `data: [DONE]`."""
    head = fmt.envelope(plan.rid, "chat.completion.chunk" if plan.chat else "text_completion",
                        plan.model)
    tool_streams = [plan.tools.stream() if plan.has_tools and plan.tools else None
                    for _ in choices]
    try:
        if plan.chat:
            for c in choices:
                # content null when tools may answer (OpenAI's form: the SDK then
                # assembles a tool-call message with content null, as in a full answer)
                yield _chunk(plan, head, c, {"index": c.index, "logprobs": None, "delta": {
                    "role": "assistant", "content": None if plan.has_tools else ""},
                    "finish_reason": None})
        async for i, out in merge(streams):
            c = choices[i]
            first = c.num_outputs == 0
            c.add(out)
            item: dict = {"index": i,
                          "finish_reason": out.finish_reason if out.finished else None}
            if out.finished:
                item["stop_reason"] = out.stop_reason
            lps = out.new_logprobs or []
            if plan.chat:
                delta = _chat_delta(tool_streams[i], out.new_text, out.finished)
                if not delta and not out.finished and not lps:
                    continue
                item["delta"] = _delta_json(delta, tool_streams[i] is None, out.finished)
                item["logprobs"] = fmt.chat_logprobs(tokenizer, lps) if lps else None
                stream = tool_streams[i]
                if out.finished and stream is not None and plan.tools is not None:
                    item["finish_reason"] = plan.tools.finish_reason(stream, out.finish_reason)
            else:
                part = _completion_part(plan, c, out.new_text, lps, first, tokenizer)
                if not part["text"] and not out.finished and not part["logprobs"]:
                    continue
                item.update(part)
                if first and plan.prompt_logprobs:
                    item["prompt_logprobs"] = fmt.prompt_logprobs(tokenizer, c.prompt_logprobs)
            yield _chunk(plan, head, c, item)
        if plan.include_usage:
            yield fmt.sse({**head, "choices": [], "usage": fmt.usage(choices)})
    except EngineDeadError as exc:
        yield fmt.sse(error_body(503, str(exc)))
    finally:
        for s in streams:
            await s.aclose()
    yield fmt.sse("[DONE]")


def _completion_part(plan: ResponsePlan, c: fmt.ChoiceState, text: str, lps: list,
                     with_prompt: bool, tokenizer) -> dict:
    """A completion choice's text and logprobs; with echo, the prompt's come first (in the
    whole answer, or in a choice's first chunk)."""
    if plan.hide_output:
        text, lps = "", []
    prompt_ids = None
    if plan.echo is not None and with_prompt:
        prompt_text, prompt_ids = plan.echo[c.index // plan.n]
        text = prompt_text + text
    logprobs = None
    if plan.logprobs and (lps or prompt_ids):
        logprobs = fmt.completion_logprobs(tokenizer, lps, 0, prompt_ids,
                                           c.prompt_logprobs if prompt_ids else None)
    return {"text": text, "logprobs": logprobs}


def _chat_delta(stream: ToolCallStream | None, text: str, finished: bool) -> ChatDelta:
    if stream is None:
        return ChatDelta(text)
    delta = stream.feed(text)
    if finished:
        rest = stream.finish()
        delta = ChatDelta(delta.content + rest.content, delta.tool_calls + rest.tool_calls)
    return delta


def _delta_json(delta: ChatDelta, plain: bool, finished: bool) -> dict:
    if plain:  # as before tools existed: content on every chunk but a bare final one
        return {"content": delta.content} if delta.content or not finished else {}
    out: dict = {}
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [t.to_json() for t in delta.tool_calls]
    return out


def _chunk(plan: ResponsePlan, head: dict, c: fmt.ChoiceState, item: dict) -> str:
    body = {**head, "choices": [item]}
    if plan.include_usage and plan.continuous_usage:  # vLLM: the choice's usage so far
        body["usage"] = {"prompt_tokens": c.num_prompt_tokens,
                         "completion_tokens": c.num_output_tokens,
                         "total_tokens": c.num_prompt_tokens + c.num_output_tokens}
    return fmt.sse(body)
