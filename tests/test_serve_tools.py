"""Tool calling and reasoning through `llmc serve` on the default model, with the real `openai` client.

The default model never learned to call tools, so what these tests check is what llmc guarantees: a
named tool or ``required`` is enforced by llguidance (arguments validate against the tool's schema,
sampled or greedy, batched with plain requests), streams reassemble to the non-streamed answer, text
that looks like a call is parsed from the answer (and only where tools are on), and every malformed
request is a 400 naming its field.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import jsonschema
import llguidance
import openai
import pytest

from llmc.runtime import Engine
from llmc.runtime.sampling.structured import GrammarCompiler
from llmc.serve import ServeConfig
from llmc.serve.tools import constraint, validate
from llmc.testing.http_server import serve_in_thread
from llmc.testing.structured_cases import random_schema

MODEL = "m"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
TOOLS = [WEATHER, NOOP]


@pytest.fixture(scope="module")
def server(default_engine):
    with serve_in_thread(Engine.load(default_engine, num_threads=1), ServeConfig(model_name=MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _tools(rng: random.Random, k: int) -> list[dict]:
    out = []
    for i in range(rng.randint(1, 3)):
        props = {f"p{j}": random_schema(rng, 1) for j in range(rng.randint(0, 3))}
        out.append({"type": "function", "function": {
            "name": f"tool_{k}_{i}", "description": f"tool {i}",
            "parameters": {"type": "object", "properties": props,
                           "required": [p for p in props if rng.random() < 0.7], "additionalProperties": False}}})
    return out


def _check_calls(calls, tools, only: str | None = None) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in by_name and (only is None or call.function.name == only)
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_named_and_required_calls_validate_over_random_schemas_batched_with_plain_requests(client):
    rng = random.Random(35)
    jobs = []
    for k in range(10):
        tools = _tools(rng, k)
        named = rng.choice(tools)["function"]["name"]
        sampled = dict(temperature=0.9, seed=k) if k % 2 else dict(temperature=0)
        jobs.append(("named", tools, named, dict(tool_choice={"type": "function", "function": {"name": named}},
                                                 **sampled)))
        jobs.append(("required", tools, None, dict(tool_choice="required", parallel_tool_calls=False, **sampled)))
        jobs.append(("plain", None, None, dict(temperature=0.7, seed=k)))

    def run(job):
        kind, tools, named, kw = job
        if tools is None:
            return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, **kw)
        return client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=300, **kw)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # all in flight at once: batched
        results = list(pool.map(run, jobs))
    for (kind, tools, named, _), r in zip(jobs, results, strict=True):
        c = r.choices[0]
        if kind == "plain":
            assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
            continue
        assert c.finish_reason == "tool_calls", (kind, c)
        assert len(c.message.tool_calls) == 1  # named: that one call; required without parallel calls: one
        _check_calls(c.message.tool_calls, tools, only=named)


def _stream(client, **kw):
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # a call's first delta: index, id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["named", "required-parallel", "sampled"])
def test_streamed_deltas_reassemble_to_the_non_streamed_calls(client, choice):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    if choice == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif choice == "required-parallel":
        kw.update(tool_choice="required", max_tokens=120)  # parallel calls may run to max_tokens
    else:
        kw.update(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7)
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
    content, _, calls, finish = _stream(client, **kw)
    assert finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    assert (content or None) == (whole.message.content or None)
    if choice == "required-parallel":
        assert finish in ("tool_calls", "length") and calls
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]),
                                next(t for t in TOOLS if t["function"]["name"] == c["name"])["function"]["parameters"])
    else:
        assert finish == "tool_calls" and len(calls) == 1


def test_text_in_the_call_format_is_a_call_under_auto_and_content_under_none(client):
    # The model cannot be made to call on its own; a grammar makes it write the format's exact text.
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    grammar = {"grammar": "start: " + json.dumps(text)}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       extra_body={"structured_outputs": grammar})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    _, _, calls, finish = _stream(client, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                  extra_body={"structured_outputs": grammar})
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    for kw in ({"tool_choice": "none"}, {}):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                           extra_body={"structured_outputs": grammar},
                                           **({"tools": TOOLS} if kw else {}), **kw)
        c = r.choices[0]
        assert c.message.tool_calls is None and c.finish_reason == "stop" and c.message.content == text


def test_none_returns_no_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24,
                                       temperature=0.8, seed=1, n=3)
    for c in r.choices:
        assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


def test_a_forced_call_cut_by_max_tokens_finishes_length_without_a_call(client):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
              max_tokens=6, temperature=0)
    c = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert c.message.content.startswith("<tool_call>")
    content, _, calls, finish = _stream(client, **kw)
    assert finish == "length" and calls == [] and content == c.message.content


def test_tool_result_round_trip_renders_as_transformers_does(client, default_engine):
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0).choices[0]
    call = first.message.tool_calls[0]
    conversation = ASK + [first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tok = AutoTokenizer.from_pretrained(str(default_engine))
    hf_conv = json.loads(json.dumps(conversation))
    for tc in hf_conv[1]["tool_calls"]:  # transformers' templates take the arguments as objects
        tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    text = tok.apply_chat_template(hf_conv, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


BAD = [
    (dict(tools=[]), "tools", "too short"),
    (dict(tool_choice="required"), "tool_choice", "only allowed when tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
     "'nope' is not one of the tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "not one of"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name", "1-64"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0].type", "not supported"),
    (dict(tools=[NOOP, NOOP]), "tools[1].function.name", "twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "tools[0].function.parameters", "JSON Schema"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], tool_choice="required"), "tools", ""),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "cannot be combined"),
    (dict(messages=ASK + [{"role": "tool", "content": "x"}], tools=TOOLS), "messages[1].tool_call_id", "needs the id"),
    (dict(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "noop", "arguments": "{not json"}}]}], tools=TOOLS), "messages[1].tool_calls[0].function.arguments",
     "not valid JSON"),
]


@pytest.mark.parametrize("kw,param,words", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_400_naming_the_field(client, kw, param, words):
    kw = {"messages": ASK, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kw)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and words in body["message"], body
    assert body["type"] == "invalid_request_error"


LAZY_CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": D}}\n</tool_call>',
               '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\nD\n"
                    "</parameter>\n</function>\n</tool_call>",
                    "<tool_call>\n<function=noop>\n</function>\n</tool_call>"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": D}}]',
                '[TOOL_CALLS][{"name": "noop", "arguments": {}}]'),
}


@pytest.mark.parametrize("family", sorted(LAZY_CALLS))
def test_strict_tools_under_auto_are_lazily_constrained(default_engine, family):
    """The lazy grammar: free text until the format's trigger, then only valid calls (checked token by token)."""
    from tokenizers import Tokenizer

    from llmc.serve.errors import APIError

    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    spec = validate([strict, NOOP], "auto", None)
    grammar = constraint(spec, family, {})
    assert grammar is not None and "[lazy]" in grammar.grammar
    assert constraint(validate(TOOLS, "auto", None), family, {}) is None  # nothing strict: unconstrained
    for other in ("llama3_json", "pythonic", "harmony"):  # calls open the answer: no trigger to wait for
        with pytest.raises(APIError, match="strict tools under tool_choice 'auto'"):
            constraint(spec, other, {})
    tj = (default_engine / "tokenizer.json").read_text()
    compiler = GrammarCompiler(tj, 4096, [0])
    tok = Tokenizer.from_str(tj)

    def accepted(text: str) -> bool:
        m = compiler.compile(grammar)
        ids = tok.encode(text).ids
        return m.validate_tokens(ids) == len(ids) and not m.is_error()

    call, not_strict = LAZY_CALLS[family]
    assert accepted("Free text, any { brace. " + call.replace("D", "3") + " and after")
    assert accepted("no call at all")
    assert not accepted("Text " + call.replace("D", "9"))  # days over its maximum
    assert not accepted(not_strict)  # noop is not strict: not a call to make here
    assert llguidance.LLMatcher is not None


# -- reasoning ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_client(default_engine):
    config = ServeConfig(model_name=MODEL, reasoning_parser="qwen3")
    with serve_in_thread(Engine.load(default_engine, num_threads=1), config) as s:
        yield openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)


def test_reasoning_is_split_streamed_and_calls_come_from_the_answer(thinking_client):
    # A grammar makes the model think (with a call-looking text inside the thought), then call.
    text = ('<think>\nmaybe <tool_call>{"name": "noop", "arguments": {}}</tool_call> then\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>')
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"grammar": "start: " + json.dumps(text)}})
    c = thinking_client.chat.completions.create(model=MODEL, **kw).choices[0]
    extra = c.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == (
        '\nmaybe <tool_call>{"name": "noop", "arguments": {}}</tool_call> then\n')
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"] and c.finish_reason == "tool_calls"
    content, reasoning, calls, finish = _stream(thinking_client, **kw)
    assert reasoning == extra["reasoning"] and [x["name"] for x in calls] == ["get_weather"] and not content
    plain = thinking_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert plain.choices[0].message.model_extra.get("reasoning") is None and plain.choices[0].message.content


@pytest.mark.parametrize("family", ["mistral", "llama3_json", "pythonic", "qwen3_coder"])
def test_other_formats_force_parse_and_stream_alike(default_engine, family):
    config = ServeConfig(model_name=MODEL, tool_call_parser=family)
    with serve_in_thread(Engine.load(default_engine, num_threads=1), config) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=200,
                      temperature=0.7, seed=3)
            whole = c.chat.completions.create(model=MODEL, **kw).choices[0]
            assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
            _check_calls(whole.message.tool_calls, TOOLS, only=None if choice == "required" else "get_weather")
            content, _, calls, finish = _stream(c, **kw)
            assert finish == "tool_calls" and not content
            assert [(x["name"], x["arguments"]) for x in calls] == [
                (t.function.name, t.function.arguments) for t in whole.message.tool_calls]


QWEN3_LIKE = ("{% for m in messages %}<|user|>\n{{ m.content }}<|endoftext|>\n{% endfor %}<|assistant|>\n"
              "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_the_qwen3_parser_reads_the_answer(tmp_path, default_engine):
    """A template that reads enable_thinking (as Qwen3's does): the kwarg changes the prompt as in transformers."""
    import shutil

    from transformers import AutoTokenizer

    engine_dir = tmp_path / "engine"
    shutil.copytree(default_engine, engine_dir)
    cfg = json.loads((engine_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_LIKE
    (engine_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(engine_dir))
    engine = Engine.load(engine_dir, num_threads=1, verify=False)  # the edited file no longer matches its sha256
    with serve_in_thread(engine, ServeConfig(model_name=MODEL, reasoning_parser="qwen3")) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0)
        for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
            r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                          extra_body={"chat_template_kwargs": kwargs} if kwargs else {})
            text = tok.apply_chat_template(ASK, tokenize=False, **(kwargs or {}))
            assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])
            assert r.choices[0].message.content and r.choices[0].message.model_extra["reasoning"] is None
