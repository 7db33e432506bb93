"""Structured outputs through `llmc serve` with the real `openai` client (response_format, structured_outputs)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serve_in_thread(Engine.load(tiny_engine, num_threads=1), ServeConfig(model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_chat_json_schema_n3_validates_and_equals_the_engine(client, tiny_engine):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a record"}],
                                       response_format=fmt, max_tokens=64, temperature=0.8, seed=5, n=3)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop" and _extra(c, "structured_incomplete") is False
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # Greedy equals the same request through Engine.generate on the templated prompt.
    r = client.completions.create(model="tiny", prompt="Record:", max_tokens=64, temperature=0,
                                  extra_body={"response_format": fmt})
    offline = Engine.load(tiny_engine, num_threads=1).generate(
        "Record:", SamplingParams(max_tokens=64, structured={"json": SCHEMA}))[0]
    assert r.choices[0].text == offline.text


def test_structured_outputs_regex_choice_grammar_and_json_object_streamed(client):
    for extra, ok in [({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
                      ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                      ({"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]/'},
                       lambda t: t.startswith("(") and t.endswith(")")),
                      ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]:
        stream = client.completions.create(model="tiny", prompt="Value:", max_tokens=48, temperature=0,
                                           stream=True, extra_body={"structured_outputs": extra})
        text, last = "", None
        for chunk in stream:
            text += chunk.choices[0].text
            last = chunk.choices[0]
        assert last.finish_reason in ("stop", "length")
        if not _extra(last, "structured_incomplete"):
            assert ok(text), (extra, text)
        else:
            assert last.finish_reason == "length"


def test_incomplete_by_max_tokens_is_flagged(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "r",
                                                                                              "schema": SCHEMA}},
                                       max_tokens=3, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "length" and _extra(c, "structured_incomplete") is True
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.message.content)


def test_bad_schema_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[a-"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=bad, max_tokens=8)
    err = info.value.body
    assert err["param"] == "response_format"
    assert err["message"].startswith("response_format.json_schema.schema: ") and "character class" in err["message"]
