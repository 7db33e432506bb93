"""/v1/responses through the real `openai` client (client.responses.create / stream / retrieve) on the
default model: text, streaming events, a function-call round trip, previous_response_id, store, 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from llmc.runtime import Engine
from llmc.serve import ServeConfig
from llmc.serve.responses import ResponseStore, _Stored
from llmc.testing.http_server import serve_in_thread

MODEL = "m"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": PARAMS}


@pytest.fixture(scope="module")
def client(default_engine):
    with serve_in_thread(Engine.load(default_engine, num_threads=1), ServeConfig(model_name=MODEL)) as s:
        yield openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)


def test_create_text_equals_the_chat_completion_of_the_same_conversation(client):
    r = client.responses.create(model=MODEL, instructions="Answer about Python.", input="What is a for loop?",
                                max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Answer about Python."}, {"role": "user", "content": "What is a for loop?"}],
        max_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert client.responses.retrieve(r.id).output_text == r.output_text


def test_stream_events_reassemble_to_the_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "The with statement"}]}],
              max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and events[-1].response.output[0].content[0].text == text


def test_function_call_round_trip_and_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris for 2 days?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                    temperature=0)
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                      max_output_tokens=8, temperature=0)
    # The same conversation given in full: the same prompt, so the same greedy answer.
    full = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        result])
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == full.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == full.output_text
    # Streamed, the call arrives as an item and its argument deltas.
    events = list(client.responses.create(model=MODEL, input="Weather in Paris for 2 days?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                          temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-1].type == "response.completed" and added and added[0].name == "get_weather"
    assert args == events[-1].response.output[-1].arguments == calls[0].arguments


def test_store_false_is_not_kept_and_bad_requests_are_400(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    bad = [
        (dict(input="x", previous_response_id=r.id), "previous_response_id", "not stored"),
        (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type", "only function tools"),
        (dict(input="x", tools=[{"type": "function", "name": "no spaces"}]), "tools[0].name", "1-64"),
        (dict(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "other"}), "tool_choice", "other"),
        (dict(input=[{"type": "image_generation_call"}]), "input[0].type", "not supported"),
        (dict(input=[{"role": "critic", "content": "x"}]), "input[0].role", "critic"),
        (dict(input="x", max_output_tokens=0), "max_output_tokens", "greater than"),
        (dict(input=[]), "input", "empty"),
    ]
    for kw, param, words in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, **kw)
        assert err.value.body["param"] == param and words in err.value.body["message"], (kw, err.value.body)


def test_store_evicts_the_oldest_first():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", _Stored([], {"id": f"r{i}"}))
    assert store.get("r0") is None and store.get("r1") and store.get("r2") and len(store) == 2
    none = ResponseStore(0)
    none.put("r", _Stored([], {}))
    assert none.get("r") is None
