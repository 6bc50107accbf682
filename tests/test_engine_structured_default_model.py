"""Structured outputs on the real default model (SmolLM2-135M-Instruct), through the `openai`
SDK: twenty JSON schemas (nested objects, enums, arrays, required fields, refs) each give
JSON that parses and validates, and a required tool call gives valid arguments.

The twenty requests run concurrently, so the engine batches constrained requests with
each other (and the grammar masks are applied to mixed rows of one step).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import openai
import pytest
from engine_server import EngineProcess

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"

S = {"type": "string", "maxLength": 24}
# Bounded: a 135M model asked for an unbounded integer can write digits until max_tokens.
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {"name": S, "age": INT},
               "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"]},
    "bool": {"type": "object", "properties": {"answer": {"type": "boolean"}},
             "required": ["answer"]},
    "number range": {"type": "object", "properties": {"score": {
        "type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    "string array": {"type": "object", "properties": {"fruits": {
        "type": "array", "items": S, "minItems": 2, "maxItems": 4}}, "required": ["fruits"]},
    "enum array": {"type": "object", "properties": {"days": {"type": "array", "items": {
        "enum": ["mon", "tue", "wed"]}, "maxItems": 3}}, "required": ["days"]},
    "nested": {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}}, "required": ["address"]},
    "deep": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": INT}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
    "array of objects": {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"]}}}, "required": ["items"]},
    "optional fields": {"type": "object", "properties": {"title": S, "subtitle": S},
                        "required": ["title"]},
    "const": {"type": "object", "properties": {"version": {"const": 2}, "name": S},
              "required": ["version", "name"]},
    "nullable": {"type": "object", "properties": {"nick": {"type": ["string", "null"],
                                                           "maxLength": 12}},
                 "required": ["nick"]},
    "anyOf": {"type": "object", "properties": {"id": {"anyOf": [
        INT, {"type": "string", "maxLength": 8}]}}, "required": ["id"]},
    "ref": {"type": "object", "$defs": {"pt": {"type": "object", "properties": {
        "x": INT, "y": INT}, "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"]},
    "top-level array": {"type": "array", "items": INT, "minItems": 1,
                        "maxItems": 5},
    "string formats": {"type": "object", "properties": {"email": {
        "type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}, "required": ["email"]},
    "many required": {"type": "object", "properties": {k: INT for k in "abcde"},
                      "required": list("abcde")},
    "mixed": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": INT, "tags": {"type": "array", "items": S, "maxItems": 2}, "meta": {
        "type": "object", "properties": {"src": S}, "required": ["src"]}},
        "required": ["ok", "n", "tags", "meta"]},
    "integer bounds": {"type": "object", "properties": {"year": {
        "type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["year"]},
    "string length": {"type": "object", "properties": {"code": {
        "type": "string", "minLength": 3, "maxLength": 6}}, "required": ["code"]},
}


@pytest.fixture(scope="module")
def client():
    proc = EngineProcess("--served-model-name", MODEL, "--max-model-len", "2048",
                         "--num-kv-blocks", "1024").wait_ready(timeout=300)
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0,
                        timeout=600)
    proc.stop()


def _ask(client, name: str, schema: dict):
    messages = [{"role": "user", "content": f"Give an example {name} as JSON matching this "
                                            f"schema: {json.dumps(schema)}"}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def test_twenty_schemas_give_valid_json(client):
    assert len(SCHEMAS) == 20
    with cf.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = dict(zip(SCHEMAS, pool.map(lambda kv: _ask(client, *kv), SCHEMAS.items())))
    failed = {}
    for name, r in answers.items():
        text = r.choices[0].message.content
        try:
            assert r.choices[0].finish_reason == "stop", "cut at max_tokens"
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failed[name] = (str(exc)[:200], text[:200])
    assert not failed, failed


def test_required_tool_call_on_the_default_model(client):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": S, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool], tool_choice="required", max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
