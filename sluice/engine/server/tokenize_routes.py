"""vLLM's `POST /tokenize` and `POST /detokenize`, same requests and answers.

/tokenize takes a prompt or chat messages and answers {count, max_model_len, tokens,
token_strs}: the ids a completion or chat request would get (the endpoint picker
tokenizes through it when it has no tokenizer of its own); token_strs are the
vocabulary strings when return_token_strs is set. /detokenize takes {tokens} and
answers {prompt}: their text (special tokens kept, as vLLM decodes there).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from sluice.engine.server.chat_render import check_chat_flags, encode_chat_request
from sluice.engine.server.errors import RequestError
from sluice.engine.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from sluice.engine.server.validation import (
    Limits,
    chat_prompt,
    check_context,
    check_text_size,
    check_token_ids,
    tokenize,
)


def add_tokenize_routes(app: FastAPI, tokenizer, limits: Limits,
                        check_model: Callable[[object], None]) -> None:
    """`check_model` also refuses unknown fields (the chat and completion routes' check)."""
    @app.post("/tokenize")
    async def tokenize_prompt(body: TokenizeChatRequest | TokenizeCompletionRequest):
        check_model(body)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", None)
        if isinstance(body, TokenizeChatRequest):
            check_chat_flags(body)
            rendered = ([m.model_dump() for m in body.messages], body.tools,
                        body.chat_template_kwargs)
            ids = await chat_prompt(rendered, lambda: encode_chat_request(tokenizer, body),
                                    limits)
        else:
            text, special = body.prompt, body.add_special_tokens
            check_text_size(len(text), limits, "prompt")
            ids = await tokenize(lambda: tokenizer.encode(text, add_special_tokens=special),
                                 len(text), "prompt")
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body)
        if tokenizer is None:
            raise RequestError("this model has no tokenizer", None)
        check_context(len(body.tokens), None, limits.max_model_len + 1, "tokens")
        check_token_ids(body.tokens, limits.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
