"""Hostile client input gets a clear 4xx in the one OpenAI error shape and harms nobody else.

One real `sluice engine` process (tiny random model, SmolLM2's tokenizer) with
lowered limits takes every kind of bad request; the last test checks it still
serves normally and never logged a traceback (no 5xx, no crashed engine loop).
A few in-process tests cover what no client input should reach (an
unexpected exception's 500) and the tokenizer wrapper.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading

import httpx
import pytest
from engine_server import EngineProcess
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sluice.engine.server.errors import RequestError, install_error_handlers
from sluice.engine.server.validation import OFF_LOOP_CHARS, tokenize
from sluice.openai_error import error_type

MODEL = "tiny-chat"
MAX_MODEL_LEN = 1024
BODY_LIMIT = 1024 * 1024
MAX_PROMPTS = 4
MAX_WAITING = 8
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    proc = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                         "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-request-body-bytes", str(BODY_LIMIT),
                         "--max-prompts-per-request", str(MAX_PROMPTS),
                         "--max-waiting-requests", str(MAX_WAITING)).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def vocab_size(tiny_chat_model) -> int:
    return json.loads((tiny_chat_model / "config.json").read_text())["vocab_size"]


def post_raw(engine, path: str, body: bytes, **kw) -> httpx.Response:
    return httpx.post(engine.url + path, content=body,
                      headers={"content-type": "application/json"}, timeout=60, **kw)


def expect_error(r: httpx.Response, status: int, param: str | None | type = ...) -> dict:
    """The response is `status` with exactly OpenAI's error keys; returns the error object."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    err = error_of(r.json(), status)
    if param is not ...:
        assert err["param"] == param, err
    return err


def error_of(body: object, status: int) -> dict:
    """The error object of an OpenAI-shaped error body for `status` (asserting the shape)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["type"] == error_type(status)
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- text that is not Unicode, bytes that are not UTF-8, JSON that is not JSON -------------
CHAT_MSG = '[{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages"),
    (COMPLETIONS, '{"prompt": "ab", "stop": ["x", "\\ud800"], "max_tokens": 2}', "stop"),
    (COMPLETIONS, '{"prompt": "ab", "stop": "\\udc00", "max_tokens": 2}', "stop"),
    (COMPLETIONS, '{"prompt": "ab", "model": "\\ud800", "max_tokens": 2}', "model"),
    (CHAT, '{"messages": ' + CHAT_MSG + ', "tools": [{"\\ud800": 1}]}', "tools"),
], ids=["prompt", "prompt-list", "chat", "chat-parts", "stop-list", "stop", "model", "key"])
def test_lone_surrogates_are_400(engine, path, body, param):
    err = expect_error(post_raw(engine, path, body.encode()), 400, param)
    assert "surrogate" in err["message"]


def test_chat_template_failure_is_400(engine):
    """Whatever encode_chat raises on client input (here a TypeError) is the client's fault."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"add_generation_prompt": False}}
    err = expect_error(httpx.post(engine.url + CHAT, json=body, timeout=60), 400, "messages")
    assert "chat template" in err["message"]


def test_invalid_utf8_is_400(engine):
    err = expect_error(post_raw(engine, COMPLETIONS, b'{"prompt": "a\xff\xfeb"}'), 400)
    assert "UTF-8" in err["message"]
    expect_error(post_raw(engine, COMPLETIONS, '{"prompt": "é"}'.encode("utf-16")), 400)


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"prompt": "x", "tools": ' + b"[" * 200 + b"]" * 200 + b"}", "tools"),
], ids=["100000", "200"])
def test_deep_nesting_is_400(engine, body, param):
    err = expect_error(post_raw(engine, COMPLETIONS, body), 400, param)
    assert "nests deeper" in err["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_400(engine, literal):
    body = f'{{"prompt": "a", "max_tokens": 2, "presence_penalty": {literal}}}'
    expect_error(post_raw(engine, COMPLETIONS, body.encode()), 400)
    body = f'{{"messages": {CHAT_MSG}, "chat_template_kwargs": {{"x": {literal}}}}}'
    expect_error(post_raw(engine, CHAT, body.encode()), 400)


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'"prompt"', b"null"])
def test_not_an_object_is_400(engine, body):
    expect_error(post_raw(engine, COMPLETIONS, body), 400)


# -- size limits ---------------------------------------------------------------------------
def _big_body() -> bytes:
    return json.dumps({"prompt": "a" * (BODY_LIMIT + 100), "max_tokens": 1}).encode()


def test_body_over_limit_is_413_with_content_length(engine):
    with httpx.Client(timeout=60) as c:
        r = c.post(engine.url + COMPLETIONS, content=_big_body(),
                   headers={"content-type": "application/json"})
        assert "content-length" in r.request.headers
        err = expect_error(r, 413, None)
        assert str(BODY_LIMIT) in err["message"]
        # The connection survives (the rest of the body was discarded) and serves on.
        assert c.post(engine.url + COMPLETIONS, json={"prompt": "a", "max_tokens": 1}
                      ).status_code == 200


def test_body_over_limit_is_413_when_chunked(engine):
    big = _big_body()

    def chunks():
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    with httpx.Client(timeout=60) as c:
        r = c.post(engine.url + COMPLETIONS, content=chunks(),
                   headers={"content-type": "application/json"})
        assert r.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in r.request.headers
        expect_error(r, 413, None)
        assert c.post(engine.url + COMPLETIONS, json={"prompt": "a", "max_tokens": 1}
                      ).status_code == 200


def test_prompt_text_is_capped_before_tokenizing(engine):
    cap = MAX_MODEL_LEN * 64  # validation.MAX_CHARS_PER_TOKEN characters per token
    r = httpx.post(engine.url + COMPLETIONS, json={"prompt": "a" * (cap + 1)}, timeout=60)
    assert "characters" in expect_error(r, 400, "prompt")["message"]
    body = {"messages": [{"role": "user", "content": "a" * (cap + 1)}]}
    expect_error(httpx.post(engine.url + CHAT, json=body, timeout=60), 400, "messages")


# -- strict types, no coercion -------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.0), ("stream", "yes"),
    ("stream", 1), ("temperature", "hot"), ("temperature", "1"), ("temperature", True),
    ("n", 1.5), ("n", "2"), ("logprobs", True), ("seed", "7"), ("ignore_eos", "true"),
    ("stop", 5), ("stop_token_ids", [True]), ("prompt", [True, 2]), ("prompt", 5),
])
def test_wrong_types_are_400(engine, field, value):
    body = {"prompt": "a", "max_tokens": 2, field: value}
    expect_error(httpx.post(engine.url + COMPLETIONS, json=body, timeout=60), 400, field)


def test_chat_wrong_types_are_400(engine):
    for field, value in [("logprobs", 1), ("max_completion_tokens", "3"),
                         ("messages", [{"role": "user", "content": 5}])]:
        body = {"messages": [{"role": "user", "content": "hi"}], field: value}
        expect_error(httpx.post(engine.url + CHAT, json=body, timeout=60), 400, field)


def test_json_integers_are_floats(engine):
    body = {"prompt": "a", "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 3}
    assert httpx.post(engine.url + COMPLETIONS, json=body, timeout=60).status_code == 200


def test_token_ids_outside_the_vocabulary_are_400(engine, vocab_size):
    for ids in ([-1, 5], [5, vocab_size], [5, 2**70], [[5], [vocab_size + 1]], [[]]):
        r = httpx.post(engine.url + COMPLETIONS, json={"prompt": ids, "max_tokens": 2},
                       timeout=60)
        expect_error(r, 400, "prompt")
    r = httpx.post(engine.url + COMPLETIONS, json={"prompt": [5, vocab_size - 1],
                                                    "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**70), ("seed", 2**70), ("seed", -(2**70)), ("stop_token_ids", [2**70]),
    ("stop_token_ids", [-1]), ("max_tokens", 2**70), ("stop", ["x"] * 65), ("stop", "x" * 1025),
])
def test_out_of_range_numbers_and_lists_are_400(engine, field, value):
    """Before: a huge top_k or stop token id overflowed inside the engine loop, which died (503
    for everyone from then on)."""
    body = {"prompt": "a", "max_tokens": 2, "temperature": 1.0, field: value}
    expect_error(httpx.post(engine.url + COMPLETIONS, json=body, timeout=60), 400, field)
    assert httpx.get(engine.url + "/health").status_code == 200


# -- batched prompts and the waiting queue -------------------------------------------------
def test_too_many_prompts_is_400(engine):
    body = {"prompt": ["a"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    err = expect_error(httpx.post(engine.url + COMPLETIONS, json=body, timeout=60), 400,
                       "prompt")
    assert "--max-prompts-per-request" in err["message"]


def test_n_times_prompts_over_the_whole_queue_is_400(engine):
    finished = engine.metric("vllm:request_success_total")
    body = {"prompt": ["a"] * MAX_PROMPTS, "n": 3, "max_tokens": 1}  # 12 > 8 places at all
    r = httpx.post(engine.url + COMPLETIONS, json=body, timeout=60)
    expect_error(r, 400, "n")  # no retry could help: not a 429
    assert engine.metric("vllm:request_success_total") == finished, "none was queued"
    body["n"] = 2  # 8 places: fits
    r = httpx.post(engine.url + COMPLETIONS, json=body, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_sub_requests_over_the_free_room_are_429_before_any_is_queued():
    from sluice.engine.server.errors import RequestError
    from sluice.engine.server.validation import check_queue_room

    check_queue_room(8, 8, 8)  # fits exactly
    with pytest.raises(RequestError) as busy:
        check_queue_room(6, 5, 8)  # fits the queue, not its free room now
    assert (busy.value.status, busy.value.retry_after) == (429, 1)
    with pytest.raises(RequestError) as never:
        check_queue_room(9, 8, 8)
    assert (never.value.status, never.value.param) == (400, "n")


# -- the context length, in vLLM's words ---------------------------------------------------
def test_prompt_plus_max_tokens_over_context_is_400(engine):
    r = httpx.post(engine.url + COMPLETIONS, json={"prompt": [5] * 1000, "max_tokens": 100},
                   timeout=60)
    assert expect_error(r, 400, "max_tokens")["message"] == (
        "This model's maximum context length is 1024 tokens. However, you requested 1100 "
        "tokens (1000 in the messages, 100 in the completion). Please reduce the length of "
        "the messages or completion.")
    r = httpx.post(engine.url + COMPLETIONS, json={"prompt": [5] * 1000, "max_tokens": 24},
                   timeout=60)
    assert r.status_code == 200  # exactly the context
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    err = expect_error(httpx.post(engine.url + CHAT, json=body, timeout=60), 400,
                       "max_completion_tokens")
    assert err["message"].startswith("This model's maximum context length is 1024 tokens.")


def test_prompt_alone_over_context_is_400(engine):
    r = httpx.post(engine.url + COMPLETIONS, json={"prompt": [5] * 1024}, timeout=60)
    assert expect_error(r, 400, "prompt")["message"] == (
        "This model's maximum context length is 1024 tokens. However, you requested 1024 "
        "tokens in the messages, Please reduce the length of the messages.")
    body = {"messages": [{"role": "user", "content": "hello " * 1100}]}
    err = expect_error(httpx.post(engine.url + CHAT, json=body, timeout=60), 400, "messages")
    assert "maximum context length is 1024 tokens" in err["message"]


# -- FastAPI's own answers -----------------------------------------------------------------
def test_unknown_path_and_wrong_method(engine):
    expect_error(httpx.get(engine.url + "/v1/nope"), 404, None)
    expect_error(httpx.post(engine.url + "/nope", json={}), 404, None)
    r = httpx.get(engine.url + COMPLETIONS)
    expect_error(r, 405, None)
    assert r.headers["allow"] == "POST"
    expect_error(httpx.delete(engine.url + "/v1/models"), 405, None)


def test_unknown_model_is_404(engine):
    r = httpx.post(engine.url + COMPLETIONS, json={"model": "nope", "prompt": "a"}, timeout=60)
    expect_error(r, 404, "model")


FUZZ_KEY = "sk-fuzz"


@pytest.mark.slow
def test_schema_fuzzing_never_gets_a_5xx(tiny_chat_model):
    """Schemathesis: valid and invalid bodies generated from the engine's OpenAPI schema.

    SLUICE_FUZZ_EXAMPLES cases per operation and mode (default 100: about 400 requests).
    Its own engine has a short context, so valid requests that leave max_tokens out
    generate a few dozen tokens, not a thousand."""
    pytest.importorskip("schemathesis")
    examples = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "100"))
    engine = EngineProcess("--model", str(tiny_chat_model), "--served-model-name", MODEL,
                           "--num-kv-blocks", "64", "--max-model-len", "96",
                           "--max-request-body-bytes", str(BODY_LIMIT),
                           "--api-key", FUZZ_KEY).wait_ready()
    try:
        _fuzz(engine, examples)
    finally:
        engine.stop()
    log = engine.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def _fuzz(engine: EngineProcess, examples: int) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    auth = {"Authorization": f"Bearer {FUZZ_KEY}"}  # (the schema is served to key holders)
    schema = schemathesis.openapi.from_url(engine.url + "/openapi.json", headers=auth)
    statuses: collections.Counter = collections.Counter()
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        for result in schema.get_all_operations():
            operation = result.ok()
            if mode == schemathesis.GenerationMode.NEGATIVE and not operation.body:
                continue  # nothing to make invalid

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def call(case) -> None:
                r = case.call(base_url=engine.url, timeout=120, headers=auth)
                statuses[r.status_code] += 1
                assert r.status_code < 500, (case.operation.label, case.body, r.text[:500])
                if r.status_code >= 400:
                    error_of(r.json(), r.status_code)

            call()
    assert sum(statuses.values()) >= examples
    print(f"schemathesis: {sum(statuses.values())} requests, statuses {dict(statuses)}")


def test_still_serves_after_hostile_input(engine):
    """Runs last: nothing above hurt the engine, and no request ever got a 5xx."""
    r = httpx.post(engine.url + COMPLETIONS, json={"model": MODEL, "prompt": "Hello",
                                                   "max_tokens": 4, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(engine.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 3, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(engine.url + "/health").status_code == 200
    log = engine.log_path.read_text()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]


# -- in process: what no client input should reach -----------------------------------------
def test_unexpected_exception_is_an_openai_shaped_500():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    expect_error(r, 500, None)
    assert "a bug" not in r.text  # internals stay in the log


def test_tokenizer_errors_become_400_and_large_text_runs_off_the_loop():
    def broken() -> list[int]:
        raise TypeError("TextEncodeInput must be Union[...]")

    with pytest.raises(RequestError) as info:
        asyncio.run(tokenize(broken, 10, "prompt"))
    assert info.value.status == 400 and info.value.param == "prompt"

    loop_thread = threading.get_ident()
    threads: list[int] = []

    def record() -> list[int]:
        threads.append(threading.get_ident())
        return [1]

    asyncio.run(tokenize(record, 10, "prompt"))
    asyncio.run(tokenize(record, OFF_LOOP_CHARS + 1, "prompt"))
    assert threads[0] == loop_thread and threads[1] != loop_thread


def test_a_list_of_bad_elements_is_one_error_not_millions():
    """Pydantic reports every bad element for every union member unless lists fail fast:
    a 12 MB `"prompt": [true, ...]` kept the event loop for half a minute."""
    from pydantic import ValidationError

    from sluice.engine.server.protocol import ChatCompletionRequest, CompletionRequest

    for model, body in [(CompletionRequest, {"prompt": [True] * 200_000}),
                        (CompletionRequest, {"prompt": ["a"] * 200_000 + [1]}),
                        (CompletionRequest, {"prompt": "a", "stop": [5] * 200_000}),
                        (ChatCompletionRequest, {"messages": [1] * 200_000}),
                        (ChatCompletionRequest, {"messages": [{"role": "user"}],
                                                 "tools": [1] * 200_000})]:
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        assert len(info.value.errors()) <= 4
