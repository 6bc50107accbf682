"""Tool-call parsing on recorded model outputs, malformed ones included: a call is found
whole or the text stays content, never an error; streamed in any chunking it gives the
same message as parsed whole."""

from __future__ import annotations

import json
import random

import pytest

from sluice.engine.server.errors import RequestError
from sluice.engine.server.protocol import ChatCompletionRequest
from sluice.engine.server.tool_calls import (
    ChatDelta,
    NamedToolCallStream,
    RequiredToolCallsParser,
    ToolCallStream,
    merge,
)
from sluice.engine.server.tool_parsers import TOOL_PARSERS, ParsedToolCall
from sluice.engine.server.tools import required_schema, tool_setup

# Outputs as Qwen2.5-7B-Instruct and Hermes-2-Pro write them.
HERMES = {
    "one call": (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "celsius"}}\n</tool_call>'),
                 None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "two calls": (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": '
                  '"Europe/Paris"}}\n</tool_call>'),
                  None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    "text first": (("Let me check that for you.\n<tool_call>\n{\"name\": \"lookup\", "
                   "\"arguments\": {\"q\": \"été\"}}\n</tool_call>"),
                   "Let me check that for you.", [("lookup", {"q": "été"})]),
    "no call": ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    "unclosed at the end": ('<tool_call>\n{"name": "f", "arguments": {}}',
                            None, [("f", {})]),
    "arguments as JSON text": (('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}'
                               '</tool_call>'), None, [("f", {"a": 1})]),
    "tag-like text": ("use a <tool> or <tool_cal", "use a <tool> or <tool_cal", []),
}
HERMES_MALFORMED = {
    "not JSON": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    "no name": '<tool_call>{"arguments": {}}</tool_call>',
    "arguments a list": '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    "cut off": '<tool_call>\n{"name": "get_weather", "argu',
    "empty block": "<tool_call></tool_call>",
}
LLAMA3 = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                 [("get_weather", {"city": "Paris"})]),
    "python tag and two calls": (('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                                 '{"name": "b", "arguments": {}}'), None,
                                 [("a", {"x": 1}), ("b", {})]),
    "text": ("It is sunny in Paris.", "It is sunny in Paris.", []),
    "not JSON": ('{"name": "get_weather", "parameters": {city: 1}}',
                 '{"name": "get_weather", "parameters": {city: 1}}', []),
    "an object that is no call": ('{"city": "Paris"}', '{"city": "Paris"}', []),
    "JSON then text": ('{"name": "a", "parameters": {}} and then', ('{"name": "a", '
                       '"parameters": {}} and then'), []),
}


def _whole(parser: str, text: str):
    stream = ToolCallStream(TOOL_PARSERS[parser]())
    return merge([stream.feed(text), stream.finish()])


def _streamed(parser: str, text: str, seed: int):
    rng, stream, deltas, i = random.Random(seed), ToolCallStream(TOOL_PARSERS[parser]()), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        deltas.append(stream.feed(text[i:i + n]))
        i += n
    deltas.append(stream.finish())
    return merge(deltas), deltas


def _calls(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize("parser,cases", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_recorded_outputs(parser, cases):
    for name, (text, content, calls) in cases.items():
        got_content, tool_calls = _whole(parser, text)
        assert (got_content, _calls(tool_calls)) == (content, calls), name
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
                   for c in tool_calls)
        for seed in range(5):
            (s_content, s_calls), _ = _streamed(parser, text, seed)
            assert (s_content, _calls(s_calls)) == (content, calls), (name, seed)


@pytest.mark.parametrize("name", sorted(HERMES_MALFORMED))
def test_malformed_hermes_calls_are_content_as_written(name):
    text = "Sure. " + HERMES_MALFORMED[name]
    assert _whole("hermes", text) == (text, [])
    assert _streamed("hermes", text, 1)[0] == (text, [])


def test_a_malformed_block_beside_a_good_one():
    good = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    bad = '<tool_call>{"name": f}</tool_call>'
    content, calls = _whole("hermes", good + "\n" + bad)
    assert content == "\n" + bad and _calls(calls) == [("f", {"a": 1})]


def test_streamed_calls_come_whole_in_one_delta_each():
    text = HERMES["two calls"][0]
    _, deltas = _streamed("hermes", text, 3)
    firsts = [t for d in deltas for t in d.tool_calls]
    assert [t.index for t in firsts] == [0, 1]
    assert all(t.id and t.name for t in firsts)
    assert not any(d.content for d in deltas)  # the newlines between calls are dropped


def test_parallel_tool_calls_false_keeps_the_first():
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    _, calls = merge([stream.feed(HERMES["two calls"][0]), stream.finish()])
    assert _calls(calls) == [("get_weather", {"city": "Paris"})]


def test_required_output_becomes_calls_as_each_element_closes():
    text = ('[{"name": "get_weather", "parameters": {"city": "Par]is}"}}, '
            '{"name": "get_time", "parameters": {}}]')
    parser = RequiredToolCallsParser()
    events = [e for ch in (text[:50], text[50:]) for e in parser.feed(ch)] + parser.finish()
    assert events == [ParsedToolCall("get_weather", '{"city": "Par]is}"}'),
                      ParsedToolCall("get_time", "{}")]
    cut = RequiredToolCallsParser()
    assert cut.parse('[{"name": "a", "parameters": {}}, {"name": "b", "par') == [
        ParsedToolCall("a", "{}"), '{"name": "b", "par']


def test_named_call_streams_its_arguments():
    stream = NamedToolCallStream("f")
    deltas = [stream.feed('{"a"'), stream.feed(""), stream.feed(": 1}"), stream.finish()]
    assert deltas[0].tool_calls[0].name == "f" and deltas[0].tool_calls[0].id
    assert deltas[1] == ChatDelta()
    assert merge(deltas)[1][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
    "$defs": {"City": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "noop"}}]


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_choice_modes():
    assert tool_setup(_chat(), None).mode == "plain"
    assert tool_setup(_chat(tools=TOOLS, tool_choice="none"), None).mode == "plain"
    assert tool_setup(_chat(tools=TOOLS), "hermes").mode == "auto"
    named = tool_setup(_chat(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "noop"}}), None)
    assert (named.mode, named.schema) == ("named", {"type": "object", "properties": {}})
    required = tool_setup(_chat(tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=False), None)
    assert required.schema["maxItems"] == 1 and "City" in required.schema["$defs"]
    assert tool_setup(_chat(tools=[], tool_choice="required"), None).mode == "plain"


@pytest.mark.parametrize("fields,words", [
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": TOOLS}, "--tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match"),
])
def test_inconsistent_tool_requests_are_400(fields, words):
    with pytest.raises(RequestError, match=words) as err:
        tool_setup(_chat(**fields), None)
    assert err.value.status == 400


def test_required_schema_refuses_conflicting_defs():
    other = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": {"City": {"type": "integer"}}}}}
    with pytest.raises(RequestError, match="City"):
        required_schema(_chat(tools=[TOOLS[0], other]).tools, True)
