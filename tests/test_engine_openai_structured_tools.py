"""The OpenAI API as vLLM serves it, through the real `openai` SDK against a real engine
process: structured outputs and tool calls (test_engine_openai_sampling.py has the
sampling fields, /tokenize, /detokenize and unknown fields).

The model is tiny and random (SmolLM2's tokenizer and template): whatever structure an
answer has, the server's constraints put it there. test_engine_structured_default_model
checks JSON schemas on the real default model.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from engine_server import EngineProcess

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow  # engine processes
MODEL = "tiny-chat"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
    "required": ["tz"]}}}


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "512", "--max-model-len", "2048",
                         "--tool-call-parser", "hermes").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", CHAT), **kw)


def complete(client, **kw):
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", "Hello"), **kw)


def streamed_chat(client, **kw):
    """The answer the SDK assembles from the stream (its own accumulator)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in chat(client, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


# -- structured outputs ---------------------------------------------------------------------
def test_regex_and_choice_hold(client):
    regex = r"[A-Z][a-z]{2,7}-[0-9]{2,4}"
    for seed in range(3):
        text = complete(client, max_tokens=40, seed=seed,
                        extra_body={"structured_outputs": {"regex": regex}}).choices[0].text
        assert re.fullmatch(regex, text), text
    choices = ["yes", "no", "it depends \"on\" you"]
    got = {chat(client, max_tokens=20, seed=s, extra_body={
        "structured_outputs": {"choice": choices}}).choices[0].message.content for s in range(6)}
    assert got <= set(choices) and len(got) > 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, max_tokens=20, seed=1, stream=True,
        extra_body={"structured_outputs": {"choice": choices}}) if c.choices)
    assert streamed in choices
    # Tokens the grammar forbids have logprob -inf: written as vLLM writes them (-9999.0),
    # since JSON has no infinity.
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=5,
             extra_body={"structured_outputs": {"choice": ["yes"]}})
    tops = r.choices[0].logprobs.content[0].top_logprobs
    assert len(tops) == 5 and min(t.logprob for t in tops) == -9999.0


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3, "items": {
        "type": "string", "enum": ["a", "b", "c"]}}, "ok": {"type": "boolean"}},
     "required": ["tags", "ok"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -5, "maximum": 5},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"]}},
     "required": ["point"]},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "enum-array", "nested"])
def test_json_schema_output_validates(client, schema):
    for body in ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": schema}}},
                 {"extra_body": {"structured_outputs": {"json": schema,
                                                        "disable_any_whitespace": True}}}):
        r = chat(client, max_tokens=400, temperature=0.7, seed=4, **body)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_invalid_constraints_are_400_naming_the_problem(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs",
         "regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
         "structured_outputs", "exactly one"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
         "structured_outputs", "whitespace_pattern"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs",
         "only one"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}],
          "tool_choice": "required"}, "tools", "nope"),
    ]
    for kw, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, max_tokens=5, **kw)
        body = err.value.body
        assert body["param"] == param and words in body["message"], body


# -- tool calls -----------------------------------------------------------------------------
def _args(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_call_parses_streamed_and_not(client):
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 500,
          "temperature": 0.8, "seed": 11}
    full = chat(client, **kw)
    streamed = streamed_chat(client, **kw)
    for r in (full, streamed):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and all(c.id.startswith("chatcmpl-tool-") and c.type == "function"
                             for c in calls)
        for c in calls:
            _args(c, {"get_weather": WEATHER, "get_time": TIME}[c.function.name])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in full.choices[
        0].message.tool_calls] == [(c.function.name, json.loads(c.function.arguments))
                                   for c in streamed.choices[0].message.tool_calls]
    one = chat(client, parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert len(one) == 1


def test_named_tool_call(client):
    kw = {"tools": [WEATHER, TIME], "max_tokens": 300, "temperature": 0.8, "seed": 2,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    for r in (chat(client, **kw), streamed_chat(client, **kw)):
        choice = r.choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's and vLLM's answer for a named call
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _args(call, WEATHER)


def test_auto_tool_call_with_the_hermes_parser(client):
    """The random model is made to write a Hermes call (a one-string choice constraint);
    the parser turns it into tool_calls, streamed and not."""
    said = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    kw = {"tools": [WEATHER], "max_tokens": 100, "temperature": 0,
          "extra_body": {"structured_outputs": {"choice": [said]}}}
    for r in (chat(client, **kw), streamed_chat(client, **kw)):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        [call] = choice.message.tool_calls
        assert (call.function.name, _args(call, WEATHER)) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})
    malformed = said.replace('"Paris"', "Paris")
    r = chat(client, **{**kw, "extra_body": {"structured_outputs": {"choice": [malformed]}}})
    assert r.choices[0].message.content == malformed and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_a_tool_conversation_is_accepted(client):
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3)
    assert r.usage.prompt_tokens > 20
    bad = [*messages[:1], {**messages[1], "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
    with pytest.raises(openai.BadRequestError, match="arguments"):
        chat(client, messages=bad, max_tokens=3)
