"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

- Validation as OpenAI does it (400 naming the field): ``tools`` non-empty, each ``{"type": "function",
  "function": {"name", "description"?, "parameters"?, "strict"?}}`` with a unique name; ``tool_choice`` one
  of ``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name": ...}}`` naming a
  given tool, and only with tools (``none`` is the default without tools, ``auto`` with them).
- The prompt: the engine's chat template gets ``tools`` (transformers' ``apply_chat_template`` semantics:
  assistant ``tool_calls`` with their arguments as objects, ``role: "tool"`` messages with their
  ``tool_call_id``). A template that does not read ``tools`` gets :data:`GENERIC_TOOL_PROMPT` as (the start
  of) the system message instead, the calls written in the hermes format, tool results as user messages.
- Enforcement: a named tool, ``required``, and ``strict: true`` tools under ``auto`` are constrained with
  llguidance to the format's wrapper around the tools' JSON Schemas (:func:`constraint`), so a forced
  call's arguments always validate; unforced ``auto`` with strict tools uses a lazy constraint that
  switches on at the format's trigger (``<tool_call>``, ``[TOOL_CALLS]``: :data:`LAZY`). pythonic and
  qwen3_coder calls are built argument by argument (each property's schema; qwen3_coder's raw strings as
  regular expressions).
- The answer: :class:`ChoiceOutput` runs the reasoning parser, then the tool parser, on a choice's text
  (whole or streamed) and gives content, reasoning and calls with their ids.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmc.runtime.sampling.structured import StructuredOutputs
from llmc.serve.errors import APIError
from llmc.serve.reasoning import ReasoningParser
from llmc.serve.tool_parsers import Parsed, ToolCall, make_parser

log = logging.getLogger("llmc.serve")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

GENERIC_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to answer. Their signatures, one JSON object per line:\n"
    "<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one block per call:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-as-a-JSON-object>}}\n</tool_call>'
)

# Forced calls are written with the separators json.dumps uses (what the parsers return, too).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LAZY = ("hermes", "qwen3_coder", "mistral")  # formats whose calls have a trigger in text: strict tools under auto


@dataclass
class ToolSpec:
    tools: list[dict]  # [{"type": "function", "function": {...}}], as given
    choice: str  # "none" | "auto" | "required" | a tool's name
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")


def validate(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSpec | None:
    """The request's tool fields checked; None when no tools are in play (no tools, or only tool_choice none)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, f"parallel_tool_calls: must be a boolean (got {parallel_tool_calls!r})",
                       param="parallel_tool_calls", code="invalid_type")
    if tools is None:
        if tool_choice is None or tool_choice == "none":
            return None
        raise APIError(400, "tool_choice: is only allowed when tools are specified", param="tool_choice",
                       code="invalid_value")
    if not isinstance(tools, list):
        raise APIError(400, f"tools: must be an array of tools (got {type(tools).__name__})", param="tools",
                       code="invalid_type")
    if not tools:
        raise APIError(400, "tools: [] is too short; give at least one tool, or leave tools out", param="tools",
                       code="empty_array")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise APIError(400, f"{where}: must be an object", param=where, code="invalid_type")
        if t.get("type") != "function":
            raise APIError(400, f"{where}.type: {t.get('type')!r} is not supported; use 'function'",
                           param=f"{where}.type", code="invalid_value")
        f = t.get("function")
        if not isinstance(f, dict):
            raise APIError(400, f"{where}.function: must be an object with a name", param=f"{where}.function",
                           code="invalid_type")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name: {name!r} must be 1-64 characters of a-z, A-Z, 0-9, _ or -",
                           param=f"{where}.function.name", code="invalid_value")
        if name in seen:
            raise APIError(400, f"{where}.function.name: {name!r} is given twice; tool names must be unique",
                           param=f"{where}.function.name", code="invalid_value")
        seen.add(name)
        if "parameters" in f and f["parameters"] is not None and not isinstance(f["parameters"], dict):
            raise APIError(400, f"{where}.function.parameters: must be a JSON Schema object",
                           param=f"{where}.function.parameters", code="invalid_type")
        if "description" in f and f["description"] is not None and not isinstance(f["description"], str):
            raise APIError(400, f"{where}.function.description: must be a string",
                           param=f"{where}.function.description", code="invalid_type")
        if "strict" in f and f["strict"] is not None and not isinstance(f["strict"], bool):
            raise APIError(400, f"{where}.function.strict: must be a boolean", param=f"{where}.function.strict",
                           code="invalid_type")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice: {choice!r} is not one of 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice",
                           code="invalid_value")
    elif isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice: a named tool is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice", code="invalid_value")
        if name not in seen:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not one of the tools given ("
                           f"{', '.join(sorted(seen))})", param="tool_choice", code="invalid_value")
        choice = name
    else:
        raise APIError(400, f"tool_choice: must be a string or an object (got {type(choice).__name__})",
                       param="tool_choice", code="invalid_type")
    return ToolSpec(tools, choice, True if parallel_tool_calls is None else parallel_tool_calls)


# -- the prompt ---------------------------------------------------------------------------------------


def template_messages(messages: list[dict], spec: ToolSpec | None, takes_tools: bool) -> tuple[list[dict], dict]:
    """The messages as the chat template gets them, and the extra context (``tools``).

    Assistant ``tool_calls`` get their arguments as objects (as transformers' templates expect); a
    template that does not read ``tools`` gets the generic prompt and the hermes format written into the
    messages instead."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls: must be an array", param=f"messages[{i}].tool_calls")
            m["tool_calls"] = [_call_for_template(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise APIError(400, f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                           param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
        out.append(m)
    if takes_tools:
        return out, ({"tools": spec.tools} if spec is not None else {})
    if spec is None and not any(m.get("tool_calls") or m.get("role") == "tool" for m in out):
        return out, {}
    flat = []
    for m in out:
        if m.get("role") == "tool":
            flat.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = "\n".join(hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            text = m.get("content") or ""
            flat.append({**{k: v for k, v in m.items() if k != "tool_calls"},
                         "content": (text + "\n" if text else "") + blocks})
        else:
            flat.append(m)
    if spec is not None:
        prompt = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False)
                                                            for t in spec.tools))
        if flat and flat[0].get("role") in ("system", "developer") and isinstance(flat[0].get("content"), str):
            flat[0] = {**flat[0], "content": prompt + "\n\n" + flat[0]["content"]}
        else:
            flat.insert(0, {"role": "system", "content": prompt})
    return flat, {}


def hermes_call(name: str, arguments: Any) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def _call_for_template(c: Any, where: str) -> dict:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise APIError(400, f"{where}: must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                       "\"arguments\"}}}}", param=where)
    f = c["function"]
    if not isinstance(f.get("name"), str):
        raise APIError(400, f"{where}.function.name: must be a string", param=f"{where}.function.name")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise APIError(400, f"{where}.function.arguments: not valid JSON ({exc})",
                           param=f"{where}.function.arguments") from exc
    return {**c, "type": c.get("type", "function"), "function": {**f, "arguments": args}}


# -- the constraint -----------------------------------------------------------------------------------


def _schema(fn: dict) -> dict:
    schema = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
    schema["x-guidance"] = {**schema.get("x-guidance", {}), **_COMPACT} if isinstance(
        schema.get("x-guidance"), dict) else dict(_COMPACT)
    return schema


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def constraint(spec: ToolSpec, family: str, special_ids: dict[str, int]) -> StructuredOutputs | None:
    """The llguidance grammar that enforces ``spec``'s choice in ``family``'s format; None when nothing is
    enforced (``none``; ``auto`` without strict tools). 400 where llmc cannot enforce it."""
    if spec.choice == "none":
        return None
    if spec.forced:
        names = spec.names if spec.choice == "required" else [spec.choice]
    else:
        names = [n for n in spec.names if spec.function(n).get("strict")]
        if not names:
            return None
    lazy = not spec.forced
    if lazy and family not in LAZY:
        raise APIError(400, f"tool_choice: strict tools under tool_choice 'auto' cannot be enforced in the "
                       f"{family} tool-call format (its calls open the answer: there is no trigger to switch the "
                       f"constraint on at; lazily enforced: {', '.join(LAZY)}); use tool_choice 'required' or "
                       "non-strict tools", param="tool_choice", code="unsupported")
    many = spec.parallel and spec.choice in ("required", "auto")
    rules: list[str] = []

    def json_args(key: str) -> list[str]:  # the wrapper's '"name": N, "<key>": ARGS' per tool
        out = []
        for k, n in enumerate(names):
            rules.append(f"args_{k}: %json {json.dumps(_schema(spec.function(n)), ensure_ascii=False)}")
            out.append(f'{_lit(json.dumps(n) + ", " + json.dumps(key) + ": ")} args_{k}')
        return out

    obj = _lit('{"name": ')
    # Each format: the trigger (a lark expression), what follows it (one group of calls), and the separator
    # between groups when several calls may be made (None: the group itself holds them).
    if family == "hermes":
        trigger, sep = _lit("<tool_call>"), '"\\n"'
        rest = f'{_lit(chr(10))} {obj} ({" | ".join(json_args("arguments"))}) {_lit("}" + chr(10) + "</tool_call>")}'
    elif family == "qwen3_coder":
        trigger, sep = _lit("<tool_call>"), '"\\n"'
        rest = "(" + " | ".join(_keyword_call(family, k, n, spec.function(n), rules) for k, n in enumerate(names)) + ")"
    elif family == "llama3_json":
        trigger, sep = obj, '"; "'
        rest = f'({" | ".join(json_args("parameters"))}) "}}"'
    elif family == "mistral":
        trigger = f"<[{special_ids['[TOOL_CALLS]']}]>" if "[TOOL_CALLS]" in special_ids else _lit("[TOOL_CALLS]")
        one = f'{obj} ({" | ".join(json_args("arguments"))}) "}}"'
        rest, sep = f'"[" {one} ' + (f'(", " {one})* ' if many else "") + '"]"', None
    elif family == "harmony":  # one call per message; the <|...|> markers are special tokens
        trigger, sep = "<|channel|>", None
        rest = "(" + " | ".join(f'{_lit("commentary to=functions." + n + " ")} <|constrain|> "json" <|message|> '
                                f"args_{k}" for k, n in enumerate(names)) + ") <|call|>"
        for k, n in enumerate(names):
            rules.append(f"args_{k}: %json {json.dumps(_schema(spec.function(n)), ensure_ascii=False)}")
    else:  # pythonic
        trigger, sep = '"["', None
        one = "(" + " | ".join(_keyword_call(family, k, n, spec.function(n), rules) for k, n in enumerate(names)) + ")"
        rest = f"{one} " + (f'(", " {one})* ' if many else "") + '"]"'
    head = '%llguidance {}\nTEXT: /(.|\\n)*/\n'
    if not lazy:
        repeat = f"({sep} call)*" if many and sep is not None else ""
        head += f"start: call {repeat}\ncall: {trigger} {rest}\n"
    elif trigger.startswith("<") and trigger.endswith(">"):  # a special token: it never occurs in text
        head += f"start: call{'*' if many else '?'} tail\ntail: TEXT\ncall: TEXT {trigger} {rest}\n"
    else:  # llguidance's lazy trigger: free text until the trigger, then a call
        head += (f"start: call{'*' if many else '?'} tail\ntail: TEXT\ntrig[lazy]: TEXT {trigger}\n"
                 f"call: trig {rest}\n")
    return StructuredOutputs(grammar=head + "\n".join(rules) + "\n")


def _subset(prefix: str, items: list[tuple[str, bool]], sep: str | None, rules: list[str]) -> str:
    """A lark expression for ``items`` in order, each present if required (else by choice), joined by ``sep``
    (a lark literal; None: no separator); its rules go to ``rules``; "" when there are no items."""
    n = len(items)
    nullable = [all(not req for _, req in items[i:]) for i in range(n + 1)]
    defined: set[str] = set()

    def name(i: int, first: bool) -> str:  # the rule for items[i:], non-empty (define it on first use)
        rule = f"{prefix}_{i}_{int(first)}"
        if rule not in defined:
            defined.add(rule)
            expr, req = items[i]
            item = expr if first or sep is None else f"{sep} {expr}"
            alts = [f"{item} {ref(i + 1, False)}".strip()]
            if not req and i + 1 < n:
                alts.append(name(i + 1, first))
            rules.append(f"{rule}: " + " | ".join(alts))
        return rule

    def ref(i: int, first: bool) -> str:
        if i == n:
            return ""
        return name(i, first) + ("?" if nullable[i] else "")

    return ref(0, True)


_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength", "pattern", "enum", "const", "default",
                "examples"}


def _keyword_call(family: str, k: int, name: str, fn: dict, rules: list[str]) -> str:
    """One tool's call in the pythonic (``name(a=1, b="x")``) or qwen3_coder (``<function=name>`` with a
    ``<parameter=a>`` block per argument) format: the properties in order, required ones always."""
    root = fn.get("parameters") or {}
    props = root.get("properties") or {}
    required = set(root.get("required") or [])
    defs = {d: root[d] for d in ("$defs", "definitions") if d in root}
    items = []
    for j, (key, sub) in enumerate(props.items()):
        sub = dict(sub) if isinstance(sub, dict) else {}
        if family == "pythonic" and not key.isidentifier():
            raise APIError(400, f"tools: {name}.{key}: not a Python identifier, so no keyword argument in the "
                           "pythonic format", param="tools", code="unsupported")
        value = f"v_{k}_{j}"
        if family == "qwen3_coder" and sub.get("type") == "string":
            rules.append(_raw_string(value, sub, name, key))
        else:
            schema = {**sub, **defs, "x-guidance": dict(_COMPACT)}
            rules.append(f"{value}: %json {json.dumps(schema, ensure_ascii=False)}")
            if family == "qwen3_coder":
                value += " " + _lit("\n</parameter>\n")
        if family == "pythonic":
            items.append((f"{_lit(key + '=')} {value}", key in required))
        else:
            items.append((f"{_lit('<parameter=' + key + '>' + chr(10))} {value}", key in required))
    args = _subset(f"a_{k}", items, '", "' if family == "pythonic" else None, rules)
    if family == "pythonic":
        return f'{_lit(name + "(")} {args} ")"'
    return f'{_lit(chr(10) + "<function=" + name + ">" + chr(10))} {args} ' \
           f'{_lit("</function>" + chr(10) + "</tool_call>")}'


def _raw_string(rule: str, schema: dict, tool: str, key: str) -> str:
    """qwen3_coder writes string arguments raw, up to ``\\n</parameter>``: a lark rule for one, with the string
    keywords of ``schema`` (length, pattern, enum, const) as a regular expression."""
    unsupported = sorted(set(schema) - _STRING_KEYS)
    if unsupported:
        raise APIError(400, f"tools: {tool}.{key}: {unsupported[0]!r} cannot be enforced on a raw string in the "
                       "qwen3_coder format", param="tools", code="unsupported")
    end = _lit("\n</parameter>\n")
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        if not all(isinstance(c, str) for c in choices):
            raise APIError(400, f"tools: {tool}.{key}: a string's enum must hold strings", param="tools",
                           code="invalid_value")
        return f"{rule}: ({' | '.join(_lit(c) for c in choices)}) {end}"
    if not any(k in schema for k in ("minLength", "maxLength", "pattern")):
        return f"{rule}[lazy]: TEXT {end}"  # anything, up to the closing tag
    # Constrained strings: no '<' or newline, so the closing tag cannot be mistaken for text.
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    parts = [f"/[^<\\n]{{{lo},{'' if hi is None else int(hi)}}}/"]
    if "pattern" in schema:
        pat = schema["pattern"]
        pat = (pat[1:] if pat.startswith("^") else "(?s:.*)" + pat)
        pat = (pat[:-1] if pat.endswith("$") and not pat.endswith("\\$") else pat + "(?s:.*)")
        parts.append("/" + pat.replace("/", "\\/") + "/")
    token = rule.upper() + "_TEXT"
    return f"{token}: {' & '.join(parts)}\n{rule}: {token} {end}"


# -- the answer -----------------------------------------------------------------------------------------


@dataclass
class Emitted:
    """What a choice's next piece of text adds: content, reasoning, and calls (index, id, call)."""

    content: str = ""
    reasoning: str = ""
    calls: list[tuple[int, str, ToolCall]] = field(default_factory=list)


class ChoiceOutput:
    """One choice's text through the reasoning parser, then the tool parser (either may be absent); the
    content is None when calls were made and no other text was."""

    def __init__(self, tool_family: str | None, tools: list[dict] | None, reasoning: str | None,
                 calls: bool = True) -> None:
        self.tools = make_parser(tool_family, tools, calls) if tool_family is not None else None
        # gpt-oss's reasoning is the harmony tool parser's analysis channel.
        self.reasoning = ReasoningParser(reasoning) if reasoning in ("qwen3", "deepseek_r1") else None
        self.calls: list[tuple[int, str, ToolCall]] = []
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []

    def feed(self, text: str) -> Emitted:
        return self._step(text, final=False)

    def finish(self, truncated: bool) -> Emitted:
        return self._step("", final=True, truncated=truncated)

    def _step(self, text: str, final: bool, truncated: bool = False) -> Emitted:
        out = Emitted()
        if self.reasoning is not None:
            r, answer = self.reasoning.feed(text)
            if final:
                r2, a2 = self.reasoning.finish()
                r, answer = r + r2, answer + a2
            out.reasoning += r
        else:
            answer = text
        if self.tools is not None:
            try:
                parsed = self.tools.feed(answer)
                if final:
                    parsed += self.tools.finish(truncated)
            except Exception:  # a parser bug must not cost the answer: the rest is content
                log.exception("tool-call parser %s failed; the rest of the answer is content",
                              type(self.tools).__name__)
                parsed = Parsed(content=self.tools._buf[self.tools._pos:])
                self.tools = None
        else:
            parsed = Parsed(content=answer)
        out.reasoning += parsed.reasoning
        for call in parsed.calls:
            entry = (len(self.calls), f"call_{uuid.uuid4().hex[:24]}", call)
            self.calls.append(entry)
            out.calls.append(entry)
        out.content = parsed.content
        if out.content:
            self.content_parts.append(out.content)
        if out.reasoning:
            self.reasoning_parts.append(out.reasoning)
        return out

    @property
    def content(self) -> str | None:
        text = "".join(self.content_parts)
        return text if text or not self.calls else None

    @property
    def reasoning_text(self) -> str | None:
        return "".join(self.reasoning_parts) if self.reasoning_parts else None


def tool_call_json(index: int | None, call_id: str, call: ToolCall) -> dict:
    out = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}
