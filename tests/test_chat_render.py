"""A chat request's prompt as vLLM renders it: tool calls and tool results through the chat
template (a Hermes-style template, as Qwen2.5's), continue_final_message, and the same
ids for the engine and the picker."""

from __future__ import annotations

import shutil

import pytest

from sluice.engine.server.chat_render import check_chat_flags, encode_chat_request
from sluice.engine.server.errors import RequestError
from sluice.engine.server.protocol import ChatCompletionRequest
from sluice.tokenizer import Tokenizer

# Shaped like Qwen2.5's template: tools listed in the system turn, assistant calls written
# as <tool_call> JSON (arguments | tojson: an object, not a string), results as
# <tool_response> in a user turn.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]


@pytest.fixture(scope="module")
def tok(tiny_chat_model, tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return Tokenizer.from_path(str(folder))


def render(tok: Tokenizer, **fields) -> str:
    body = ChatCompletionRequest(**{"messages": CONVERSATION, **fields})
    check_chat_flags(body)
    return tok.decode(encode_chat_request(tok, body), skip_special_tokens=False)


def test_tool_calls_and_results_render_through_the_template(tok):
    text = render(tok, tools=[TOOL])
    assert '"name": "get_weather"' in text and '"parameters"' in text  # the tools
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in text  # arguments as an object, not a JSON string
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_empty_arguments_and_missing_content(tok):
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]
    text = render(tok, messages=[{"role": "assistant", "tool_calls": calls}])
    assert '{"name": "f", "arguments": {}}' in text


def test_invalid_arguments_are_refused(tok):
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]
    with pytest.raises(ValueError, match="arguments"):
        render(tok, messages=[{"role": "assistant", "tool_calls": calls}])


def test_continue_final_message(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}]
    text = render(tok, messages=messages, add_generation_prompt=False,
                  continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello th")
    with pytest.raises(RequestError, match="Cannot set both"):
        render(tok, messages=messages, continue_final_message=True)


def test_the_picker_renders_the_same_ids(tok, tiny_chat_model, tmp_path):
    """The endpoint picker tokenizes chats itself for prefix routing: same template, same
    messages (tool calls included), same ids as the engine."""
    from sluice.gateway.prompt.tokenize import PromptTokenizer

    folder = tmp_path / "m"
    shutil.copytree(tiny_chat_model, folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    picker = PromptTokenizer.from_paths([str(folder)])
    body = {"model": "m", "messages": CONVERSATION, "tools": [TOOL]}
    engine_ids = encode_chat_request(tok, ChatCompletionRequest(**body))
    assert picker.token_ids("chat", body) == engine_ids
