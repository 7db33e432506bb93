"""Tool-call and reasoning parsers on fixed texts, whole and fed in random chunks; chat templates with tools
rendered by llmc serve exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
import random

import pytest

from llmc.serve.chat import ChatTemplate
from llmc.serve.reasoning import ReasoningParser
from llmc.serve.tool_parsers import Parsed, ToolCall, family_of_template, make_parser, parse
from llmc.serve.tools import ChoiceOutput, template_messages, validate

NESTED = {"q": {"deep": [1, {"x": "}{]["}], "s": "a \"quoted\" {brace}"}, "e": {}}
NESTED_TEXT = json.dumps(NESTED)


def _calls(*pairs) -> list[ToolCall]:
    return [ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in pairs]


QWEN_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "s": {"type": "string"}, "o": {"type": "object"}, "b": {"type": "boolean"}}}}}]

# (family, text, content, calls, reasoning)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", _calls(("get_weather", {"city": "Paris"})), ""),
    ("hermes", f'<tool_call>\n{{"name": "a", "arguments": {NESTED_TEXT}}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": {}}\n</tool_call>', "", _calls(("a", NESTED), ("b", {})), ""),
    ("hermes", '<tool_call>{"name": "x", "arguments": "{\\"k\\": 1}"}</tool_call>', "", _calls(("x", {"k": 1})), ""),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call> and more", "<tool_call>\nnot json at all\n</tool_call> "
     "and more", [], ""),
    ("hermes", 'Plain answer, a brace { and "<tool" text.', 'Plain answer, a brace { and "<tool" text.', [], ""),
    ("hermes", '<tool_call>\n{"name": "u", "arguments": {"a": 1}}', "", _calls(("u", {"a": 1})), ""),  # no close tag
    ("llama3_json", f'{{"name": "a", "parameters": {NESTED_TEXT}}}', "", _calls(("a", NESTED)), ""),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"z": [1, 2]}}', "",
     _calls(("a", {}), ("b", {"z": [1, 2]})), ""),
    ("llama3_json", 'The answer is {"name": "a"} in JSON.', 'The answer is {"name": "a"} in JSON.', [], ""),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', [], ""),
    ("mistral", f'[TOOL_CALLS][{{"name": "a", "arguments": {NESTED_TEXT}}}, {{"name": "b", "arguments": {{}}}}]', "",
     _calls(("a", NESTED), ("b", {})), ""),
    ("mistral", 'Sure[TOOL_CALLS]get[ARGS]{"city": "}"}[TOOL_CALLS]two[ARGS]{}', "Sure",
     _calls(("get", {"city": "}"}), ("two", {})), ""),
    ("mistral", "[TOOL_CALLS] oops no json", "[TOOL_CALLS] oops no json", [], ""),
    ("pythonic", '[get_weather(city="San ]Francisco)", days=3), noop(), f(x={"a": [1, None, True]})]', "",
     _calls(("get_weather", {"city": "San ]Francisco)", "days": 3}), ("noop", {}),
            ("f", {"x": {"a": [1, None, True]}})), ""),
    ("pythonic", "<|python_start|>[a(b='it''s')]<|python_end|>", "", _calls(("a", {"b": "its"})), ""),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", [], ""),
    ("pythonic", "Hello [f()]", "Hello [f()]", [], ""),
    ("qwen3_coder", "I will call it.\n<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\n"
     "line 1\n{not json}\n</parameter>\n<parameter=o>\n{\"k\": [1, 2]}\n</parameter>\n<parameter=b>\ntrue\n"
     "</parameter>\n</function>\n</tool_call>", "I will call it.",
     _calls(("f", {"n": 42, "s": "line 1\n{not json}", "o": {"k": [1, 2]}, "b": True})), ""),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>\n</tool_call><tool_call>\n<function=g>\n<parameter=x>\n"
     "1.5\n</parameter>\n</function>\n</tool_call>", "", _calls(("f", {}), ("g", {"x": "1.5"})), ""),
    ("qwen3_coder", "<tool_call>\ngarbage\n</tool_call>", "<tool_call>\ngarbage\n</tool_call>", [], ""),
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     f"to=functions.get <|constrain|>json<|message|>{NESTED_TEXT}<|call|>", "", _calls(("get", NESTED)),
     "Need the weather."),
    ("harmony", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
     "<|return|>", "It is 4.", [], "Easy."),
    ("harmony", "<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>", "",
     _calls(("a", {})), ""),
    ("harmony", "<|channel|>commentary to=functions.a <|constrain|>json<|message|>{broken<|call|>", "{broken", [], ""),
]


def _chunked(family: str, text: str, rng: random.Random, tools=None) -> Parsed:
    p = make_parser(family, tools)
    out, i = Parsed(), 0
    while i < len(text):
        k = rng.randint(1, 7)
        out += p.feed(text[i:i + k])
        i += k
    out += p.finish()
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_fixed_texts_whole_and_in_random_chunks(case):
    family, text, content, calls, reasoning = case
    tools = QWEN_TOOLS if family == "qwen3_coder" else None
    whole = parse(family, text, tools)
    assert (whole.content, whole.calls, whole.reasoning) == (content, calls, reasoning)
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(25):
        got = _chunked(family, text, rng, tools)
        assert (got.content, got.calls, got.reasoning) == (content, calls, reasoning)
    for a in calls:
        assert isinstance(json.loads(a.arguments), dict)


def test_a_call_cut_by_max_tokens_is_content_not_a_call():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "argum'
    got = parse("hermes", text, truncated=True)
    assert got.calls == _calls(("a", {})) and got.content.startswith("<tool_call>\n{\"name\": \"b\"")
    got = parse("hermes", '<tool_call>\n{"name": "b", "arguments": {}}\n</tool', truncated=True)
    assert got.calls == [] and got.content.endswith("</tool")


def test_streaming_holds_a_marker_back_until_it_is_known():
    p = make_parser("hermes")
    assert p.feed("Hello <tool_").content == "Hello"
    assert p.feed("cal").content == ""
    out = p.feed('l>{"name": "f", "arguments": {}}</tool_call>')
    assert out.calls == _calls(("f", {})) and out.content == ""
    p = make_parser("hermes")
    assert p.feed("a <tool_").content == "a"
    assert p.feed("box>").content == " <tool_box>"


@pytest.mark.parametrize("family,text,reasoning,answer", [
    ("qwen3", "<think>\nsteps {with braces}\n</think>\n\nThe answer.", "\nsteps {with braces}\n", "The answer."),
    ("qwen3", "No thinking here.", "", "No thinking here."),
    ("deepseek_r1", "thinking...</think>\n\nAnswer", "thinking...", "Answer"),
    ("deepseek_r1", "<think>all thought, never closed", "all thought, never closed", ""),
])
def test_reasoning_parsers_whole_and_chunked(family, text, reasoning, answer):
    rng = random.Random(0)
    for trial in range(20):
        p = ReasoningParser(family)
        r, a, i = "", "", 0
        while i < len(text):
            k = len(text) if trial == 0 else rng.randint(1, 5)
            x, y = p.feed(text[i:i + k])
            r, a, i = r + x, a + y, i + k
        x, y = p.finish()
        assert (r + x, a + y) == (reasoning, answer)


def test_harmony_without_tools_offered_reads_reasoning_and_keeps_calls_as_text():
    text = ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary to=functions.f "
            "<|constrain|>json<|message|>{}<|call|>")
    out = ChoiceOutput("harmony", None, "gpt_oss", calls=False)
    out.feed(text)
    out.finish(truncated=False)
    assert out.calls == [] and out.reasoning_text == "hmm" and out.content == "{}"


def test_tool_calls_come_from_the_answer_never_from_the_reasoning():
    text = ('<think>maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call></think>\n'
            '<tool_call>{"name": "right", "arguments": {"a": 1}}</tool_call>')
    out = ChoiceOutput("hermes", None, "qwen3")
    out.feed(text)
    out.finish(truncated=False)
    assert [c.name for _, _, c in out.calls] == ["right"]
    assert "wrong" in out.reasoning_text and out.content is None


# -- chat templates with tools, as transformers renders them ------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]

TEMPLATES = {
    "hermes": (
        "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else '' }}\n\n"
        "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
        "{%- endif %}\n"
        "{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
        "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
        "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
        "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}\n"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3_json": (
        "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}"
        "<|end_header_id|>\n\n"
        "{%- if m.tool_calls %}{% for tc in m.tool_calls %}{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
        "{{ tc.function.arguments | tojson }}}{% endfor %}"
        "{%- elif loop.first and tools %}Functions:\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
        "{{ m.content }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "mistral": (
        "<s>{% for m in messages %}{% if m.role == 'user' %}{% if loop.last or loop.index0 == 1 and tools %}"
        "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
        "{%- elif m.tool_calls %}[TOOL_CALLS]{% for tc in m.tool_calls %}{{ tc.function.name }}[ARGS]"
        "{{ tc.function.arguments | tojson }}{% endfor %}</s>"
        "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
        "{%- elif m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]{% endif %}{% endfor %}"),
    "pythonic": (
        "{% for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n\n"
        "{%- if m.role == 'system' and tools %}Here is a list of functions in JSON format. Reply with "
        "[func_name1(params_name1=params_value1)]:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
        "{% endif %}"
        "{%- if m.tool_calls %}[{% for tc in m.tool_calls %}{{ tc.function.name }}("
        "{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}"
        "{%- endfor %}){% endfor %}]{% else %}{{ m.content }}{% endif %}<|eot|>{% endfor %}"
        "{%- if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"),
    "qwen3_coder": (
        "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n<function>\n<name>{{ t.function.name }}"
        "</name>\n</function>{% endfor %}\n</tools>\nCall as <tool_call>\n<function=NAME>\n<parameter=P>\nV\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
        "{%- for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
        "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>\n<function={{ tc.function.name }}>\n"
        "{%- for k, v in tc.function.arguments.items() %}\n<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>{% endfor %}\n</function>\n</tool_call>{% endfor %}"
        "{%- else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "harmony": (
        "{% for m in messages %}{% if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}"
        "{%- if tools %}\n\n# Tools\n\nnamespace functions {\n{% for t in tools %}type {{ t.function.name }} = "
        "(_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}} // namespace functions{% endif %}<|end|>"
        "{%- elif m.tool_calls %}{% for tc in m.tool_calls %}<|start|>assistant<|channel|>commentary "
        "to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}"
        "<|call|>{% endfor %}"
        "{%- elif m.role == 'tool' %}<|start|>functions.{{ messages[loop.index0 - 1].tool_calls[0].function.name }} "
        "to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>"
        "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from llmc.testing.corpus import train_bpe_tokenizer

    tok = train_bpe_tokenizer(vocab_size=300)
    assert isinstance(tok, PreTrainedTokenizerFast)
    return tok


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_chat_templates_with_tools_render_as_transformers_does(family, hf_tokenizer):
    source = TEMPLATES[family]
    assert family_of_template(source) == family
    # transformers' templates read the arguments of past calls as objects (what llmc serve hands them).
    hf_conv = json.loads(json.dumps(CONVERSATION))
    hf_conv[2]["tool_calls"][0]["function"]["arguments"] = json.loads(
        hf_conv[2]["tool_calls"][0]["function"]["arguments"])
    want = hf_tokenizer.apply_chat_template(hf_conv, tools=TOOLS, chat_template=source, tokenize=False,
                                            add_generation_prompt=True)
    template = ChatTemplate(source, {})
    assert template.takes_tools
    spec = validate(TOOLS, None, None)
    messages, extra = template_messages(CONVERSATION, spec, template.takes_tools)
    got = template.render(messages, add_generation_prompt=True, extra=extra)
    assert got == want
    assert "get_weather" in got and "Paris" in got and "sunny" in got


def test_default_model_template_takes_tools_and_renders_as_transformers(hf_tokenizer):
    from llmc.testing.corpus import CHAT_TEMPLATE

    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"})
    assert template.takes_tools and family_of_template(CHAT_TEMPLATE) == "hermes"
    hf_conv = json.loads(json.dumps(CONVERSATION))
    hf_conv[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    want = hf_tokenizer.apply_chat_template(hf_conv, tools=TOOLS, chat_template=CHAT_TEMPLATE, tokenize=False,
                                            add_generation_prompt=True)
    messages, extra = template_messages(CONVERSATION, validate(TOOLS, None, None), True)
    got = template.render(messages, add_generation_prompt=True, extra=extra)
    assert got == want
    # The past call is written exactly as the hermes parser reads it back.
    block = got[got.index("<tool_call>\n{\"name\": \"get_weather\""):]
    assert parse("hermes", block[:block.index("</tool_call>") + 12]).calls == _calls(
        ("get_weather", {"city": "Paris", "days": 2}))


def test_a_template_without_tools_gets_the_generic_prompt_and_hermes_blocks():
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    template = ChatTemplate(plain, {})
    assert not template.takes_tools
    messages, extra = template_messages(CONVERSATION, validate(TOOLS, None, None), False)
    text = template.render(messages, extra=extra)
    assert extra == {}
    assert text.startswith("[system] # Tools") and "You are helpful." in text
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert parse("hermes", text[text.index("<tool_call>", text.index("[assistant]")):]).calls[0].name == "get_weather"


# -- the grammars that force calls, per format ---------------------------------------------------------------

FORCED = [("hermes", '<tool_call>\n{"name": "w", "arguments": ARGS}\n</tool_call>'),
          ("llama3_json", '{"name": "w", "parameters": ARGS}'),
          ("mistral", '[TOOL_CALLS][{"name": "w", "arguments": ARGS}]'),
          ("harmony", "<|channel|>commentary to=functions.w <|constrain|>json<|message|>ARGS<|call|>"),
          ("pythonic", "[w(ARGS)]"),
          ("qwen3_coder", "<tool_call>\n<function=w>\nARGS</function>\n</tool_call>")]


def _args(family: str, args: dict) -> str:
    """``args`` written as ``family`` writes a call's arguments."""
    if family == "pythonic":
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
    if family == "qwen3_coder":
        return "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                       for k, v in args.items())
    return json.dumps(args)


@pytest.mark.parametrize("family,template", FORCED, ids=[f[0] for f in FORCED])
def test_forcing_grammar_accepts_exactly_valid_calls_and_the_parser_reads_them_back(family, template):
    from llmc.runtime.sampling.structured import GrammarCompiler
    from llmc.serve.tools import constraint
    from llmc.testing.corpus import train_bpe_tokenizer

    specials = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "[TOOL_CALLS]"]
    tok = train_bpe_tokenizer(vocab_size=300)
    tok.add_special_tokens({"additional_special_tokens": specials})
    compiler = GrammarCompiler(tok.backend_tokenizer.to_str(), len(tok), [0])
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"c": {"type": "string"}, "n": {"type": "integer", "maximum": 5},
                                         "p": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                         "o": {"type": "object", "properties": {"k": {"type": "boolean"}},
                                               "required": ["k"]}},
        "required": ["c"], "additionalProperties": False}}}
    grammar = constraint(validate([tool], "required", False), family, {t: tok.convert_tokens_to_ids(t)
                                                                        for t in specials})

    def accepted(text: str) -> bool:
        m = compiler.compile(grammar)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return m.validate_tokens(ids) == len(ids) and not m.is_error()

    for args in ({"c": "x", "n": 3}, {"c": "a b", "p": "abc", "o": {"k": True}}, {"c": "y"}):
        good = template.replace("ARGS", _args(family, args))
        assert accepted(good), good
        assert parse(family, good, [tool]).calls == [ToolCall("w", json.dumps(args))]
    assert not accepted(template.replace("ARGS", _args(family, {"c": "x", "n": 9})))  # over the maximum
    assert not accepted(template.replace("ARGS", _args(family, {"n": 3})))  # c is required
    assert not accepted(template.replace("ARGS", _args(family, {"c": "x", "p": "toolong"})))  # the pattern
    assert not accepted(template.replace('"w"', '"v"').replace("functions.w", "functions.v").replace(
        "w(", "v(").replace("=w>", "=v>").replace("ARGS", _args(family, {"c": "x"})))  # another tool


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "{", "}", "[", "]", '"', "\\", '"name"', ": ", ", ", '"f"',
             '"arguments"', '"parameters"', "{}", "\n", " ", "text", ";", "[TOOL_CALLS]", "[ARGS]", "f(", ")", "=1",
             "'", "<function=f>", "</function>", "<parameter=a>", "</parameter>", "<|channel|>", "<|message|>",
             "<|end|>", "<|call|>", "<|start|>", "analysis", "final", "commentary to=functions.f ", "<|python_tag|>",
             "<think>", "</think>", "[" * 40, "{" * 30]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "harmony"])
def test_random_texts_never_raise_and_stream_as_they_parse_whole(family):
    rng = random.Random(family)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        whole = parse(family, text, QWEN_TOOLS)
        got = _chunked(family, text, rng, QWEN_TOOLS)
        assert (got.content, got.calls, got.reasoning) == (whole.content, whole.calls, whole.reasoning), text
        for c in whole.calls:
            assert isinstance(json.loads(c.arguments), dict)
        if not whole.calls and family not in ("harmony",):  # no call: nothing is lost, only edge space
            assert whole.content.strip() == text.strip()
