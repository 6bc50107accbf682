"""A chat request's prompt token ids, rendered as vLLM renders them.

The chat template gets the messages (`template_messages`, shared with the gateway),
the tools as the client sent them, add_generation_prompt and chat_template_kwargs.
With continue_final_message the text is cut where the final message's content ends,
so the model continues that message (transformers' rule, which vLLM uses); it and
add_generation_prompt exclude each other. The text is encoded with
add_special_tokens (False by default: the template writes its own).
"""

from __future__ import annotations

from typing import Any

from sluice.engine.server.errors import RequestError


def check_chat_flags(body: Any) -> None:
    if body.continue_final_message and body.add_generation_prompt:
        raise RequestError("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.", "continue_final_message")


def encode_chat_request(tokenizer, body: Any) -> list[int]:
    """Token ids of the rendered chat; raises (ValueError, TypeError, jinja errors) on
    input the template refuses: the caller answers 400 (`validation.tokenize`)."""
    messages = body.message_dicts()
    text = tokenizer.apply_chat_template(messages, body.add_generation_prompt,
                                         body.tool_dicts(), **(body.chat_template_kwargs or {}))
    if body.continue_final_message:
        text = _cut_after_final_message(text, messages[-1].get("content"))
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def _cut_after_final_message(text: str, final: Any) -> str:
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text content")
    for needle in (final, final.strip()):  # some templates trim messages before rendering
        at = text.rfind(needle)
        if at >= 0:
            return text[:at + len(needle)]
    raise ValueError("continue_final_message: the final message does not appear in the "
                     "rendered chat template")
