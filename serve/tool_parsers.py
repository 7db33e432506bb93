"""Tool-call parsers, one per format family, each usable on a whole text or fed a stream in chunks.

A parser turns the model's answer text into content (the text that is not a call), calls (name and
arguments as JSON text) and, for gpt-oss's harmony format, reasoning. Every parser is a streaming
parser: :meth:`ToolParser.feed` takes the next piece of text and returns what became certain,
:meth:`ToolParser.finish` the rest; :func:`parse` is ``feed(whole text)`` then ``finish()``, so a
stream and a whole text give the same calls by construction, however the text was cut.

A call is returned once its text is complete and parses (a stream never announces a call that the
whole text would not have); text that looks like a call but does not parse is returned as content,
never an error. Content that may be the beginning of a call marker is held back until it is known.

Families (``--tool-call-parser``):

- ``hermes`` (Hermes, Qwen2.5/Qwen3, llmc's default model): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}`` (``;``-separated for
  several), optionally after ``<|python_tag|>``
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``
- ``pythonic`` (Llama 3.2/4, Pythonic models): the answer is ``[f(a=1, b="x"), g()]``
- ``qwen3_coder``: ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>``;
  the ``analysis`` channel is reasoning, ``final`` the content.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "harmony")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass
class Parsed:
    """What one :meth:`ToolParser.feed` or :meth:`ToolParser.finish` made certain."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        self.reasoning += other.reasoning
        return self


def _args_text(value: Any) -> str | None:
    """Arguments as JSON object text; a string holding a JSON object is accepted too; None otherwise."""
    if value is None:
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call_from_obj(obj: Any, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        return _call_from_obj(obj["function"], args_keys)
    raw = next((obj[k] for k in args_keys if k in obj), {})
    args = _args_text(raw)
    return None if args is None else ToolCall(obj["name"], args)


def _calls_from_json(text: str, args_keys=("arguments", "parameters")) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = [_call_from_obj(v, args_keys) for v in items]
    return None if any(c is None for c in calls) else calls


def json_end(s: str, i: int, memo: dict | None = None) -> int | None:
    """The index after the JSON object or array opening at ``s[i]`` (braces inside strings are text);
    None while it is incomplete; -1 if ``s[i]`` opens neither. ``memo``: where an earlier call on a
    shorter ``s`` (the same text, grown) stopped, so a stream scans each character once."""
    if i >= len(s) or s[i] not in "{[":
        return -1
    depth, in_str, esc, start = 0, False, False, i
    if memo is not None and memo.get("i") == i:
        depth, in_str, esc, start = memo["depth"], memo["in_str"], memo["esc"], memo["pos"]
    for j in range(start, len(s)):
        ch = s[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    if memo is not None:
        memo.update(i=i, depth=depth, in_str=in_str, esc=esc, pos=len(s))
    return None


def _python_end(s: str, i: int) -> int | None:
    """As :func:`json_end` for a Python list/call expression (quotes ' and \", brackets of every kind)."""
    if i >= len(s) or s[i] != "[":
        return -1
    depth, quote, esc = 0, None, False
    j = i
    while j < len(s):
        ch = s[j]
        if quote:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif s.startswith(quote, j):
                j += len(quote) - 1
                quote = None
        elif ch in "\"'":
            quote = ch * 3 if s.startswith(ch * 3, j) else ch
            j += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of a marker (held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolParser:
    """Base of the marker-delimited families: content until a marker, then a call region.

    Subclasses set ``markers`` and implement :meth:`region_end` (where the region that starts at a marker
    ends: an index, or None while it may go on) and :meth:`parse_region` (its calls, or None: content).
    ``at_start``: a call region may only open the answer (after whitespace, or right after another region).
    """

    markers: tuple[str, ...] = ()
    at_start = False
    needs_special_tokens = False  # the markers are special tokens: decode the output with them kept

    def __init__(self, tools: list[dict] | None = None, calls: bool = True) -> None:
        self.allow_calls = calls  # False: no tools were offered, so a call is only text (harmony's reasoning)
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if isinstance(t, dict)
                      and isinstance(t.get("function"), dict) and "name" in t["function"]}
        self._buf = ""
        self._pos = 0  # text before this is decided
        self._region: int | None = None  # start of an open call region
        self._closed = False  # at_start families: no call can come any more
        self._after_region = False
        self._scan: dict = {}  # json_end's progress in the open region
        self._ws = ""  # content's trailing whitespace, held: dropped if a call follows it
        self._trim = False  # a call was the last thing: drop the whitespace that follows it

    def _say(self, out: Parsed, text: str) -> None:
        """Content, less the whitespace that only separates it from calls."""
        if self._trim:
            text = text.lstrip()
            if not text:
                return
            self._trim = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        out.content += body

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._advance(final=False)

    def finish(self, truncated: bool = False) -> Parsed:
        """The rest. ``truncated``: the text was cut (max_tokens), so an open call is content, not a call."""
        out = self._advance(final=not truncated)
        if self._region is not None:
            rest = self._buf[self._region:]
            calls = None if truncated else self.parse_region(rest, final=True)
            if calls is None:
                self._say(out, rest)
            else:
                out.calls += calls
                self._ws, self._trim = "", True
            self._region = None
        elif self._pos < len(self._buf):
            self._say(out, self._buf[self._pos:])
        if not self._trim:
            out.content += self._ws
        self._ws = ""
        self._pos = len(self._buf)
        return out

    def _advance(self, final: bool) -> Parsed:
        out, buf = Parsed(), self._buf
        while True:
            if self._region is None:
                start = self._find_start(buf, final)
                if start is None:  # nothing decided past what may still become a marker
                    break
                i, is_region = start
                self._say(out, buf[self._pos:i])
                self._pos = i
                if not is_region:
                    break
                self._region = i
            end = self.region_end(buf, self._region, final)
            if end is None:
                break
            calls = self.parse_region(buf[self._region:end], final=True)
            if calls is None:
                self._say(out, buf[self._region:end])
                self._closed = self.at_start
            else:
                out.calls += calls
                self._ws, self._trim = "", True
                self._after_region = True
            self._pos, self._region = end, None
        return out

    def _find_start(self, buf: str, final: bool) -> tuple[int, bool] | None:
        """(index, True) where a region starts; (index, False): text up to index is content and no region
        starts yet; None: nothing new is decided."""
        if self._closed:
            return (len(buf), False)
        if self.at_start:
            j = _skip_ws(buf, self._pos)
            if j == len(buf):  # only whitespace so far: it may precede a call
                return (len(buf), False) if final else None
            for m in self.markers:
                if buf.startswith(m, j):
                    if self._after_region:
                        self._pos = j  # the whitespace between calls is no content
                    return (j, True)
                if m.startswith(buf[j:]) and not final:
                    return None
            k = self.continue_after_region(buf, j, final) if self._after_region else None
            if k == -1:
                return None
            if k is not None:
                self._pos = k  # the separator is no content either
                return (k, True)
            self._closed = True
            return (len(buf), False)
        best = None
        for m in self.markers:
            k = buf.find(m, self._pos)
            if k >= 0 and (best is None or k < best):
                best = k
        if best is not None:
            return (best, True)
        hold = 0 if final else _partial_suffix(buf[self._pos:], self.markers)
        return (len(buf) - hold, False)

    def continue_after_region(self, buf: str, j: int, final: bool) -> int | None:
        """at_start families: where a further region starts after a call (e.g. after ``;``), -1 to wait."""
        return None

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        raise NotImplementedError

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        raise NotImplementedError


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = _skip_ws(buf, start + len(self.OPEN))
        if j == len(buf):
            return None
        e = json_end(buf, j, self._scan)
        if e is None:
            return None
        if e == -1:  # not JSON: up to the closing tag, content
            k = buf.find(self.CLOSE, j)
            return k + len(self.CLOSE) if k >= 0 else None
        k = _skip_ws(buf, e)
        if buf.startswith(self.CLOSE, k):
            return k + len(self.CLOSE)
        if not final and self.CLOSE.startswith(buf[k:]):
            return None  # the closing tag may be arriving
        return e  # a complete call without its closing tag

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.OPEN):].strip()
        if body.endswith(self.CLOSE):
            body = body[: -len(self.CLOSE)].strip()
        return _calls_from_json(body)


class Llama3JsonParser(ToolParser):
    markers = ("<|python_tag|>", "{")
    at_start = True

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = start
        if buf.startswith("<|python_tag|>", j):
            j += len("<|python_tag|>")
        j = _skip_ws(buf, j)
        if j == len(buf):
            return None
        e = json_end(buf, j, self._scan)
        if e is None:
            return None
        return e if e != -1 else len(buf) if final else None

    def continue_after_region(self, buf: str, j: int, final: bool) -> int | None:
        if buf[j] != ";":
            return None
        k = _skip_ws(buf, j + 1)
        if k == len(buf):
            return len(buf) if final else -1
        return k if buf[k] == "{" else None

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        return _calls_from_json(body, ("parameters", "arguments"))


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    OPEN = "[TOOL_CALLS]"

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = _skip_ws(buf, start + len(self.OPEN))
        if j == len(buf):
            return None
        if buf[j] in "[{":
            return json_end(buf, j, self._scan)
        k = buf.find("[ARGS]", j)  # name[ARGS]{...}
        if k < 0:
            return len(buf) if final else None
        a = _skip_ws(buf, k + len("[ARGS]"))
        if a == len(buf):
            return None
        e = json_end(buf, a, self._scan)
        return e if e != -1 else (len(buf) if final else None)

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.OPEN):].strip()
        if body[:1] in ("[", "{"):
            return _calls_from_json(body)
        name, sep, args = body.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            return None
        a = _args_text(args.strip())
        return None if a is None else [ToolCall(name, a)]


class PythonicParser(ToolParser):
    markers = ("<|python_start|>", "[")
    at_start = True

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = start
        if buf.startswith("<|python_start|>", j):
            j = _skip_ws(buf, j + len("<|python_start|>"))
        if j == len(buf):
            return None
        e = _python_end(buf, j)
        if e is None:
            return None
        if e == -1:
            return len(buf) if final else None
        k = _skip_ws(buf, e)
        if buf.startswith("<|python_end|>", k):
            return k + len("<|python_end|>")
        if not final and "<|python_end|>".startswith(buf[k:]):
            return None  # the closing tag may be arriving
        return e

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name | ast.Attribute):
                return None
            name = ast.unparse(node.func)
            try:
                args = {kw.arg: ast.literal_eval(_json_names(kw.value)) for kw in node.keywords if kw.arg is not None}
            except (ValueError, SyntaxError, TypeError, RecursionError):
                return None
            if len(args) != len(node.keywords):
                return None
            try:
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            except (TypeError, ValueError, RecursionError):  # a set, bytes, complex: no JSON for it
                return None
        return calls


class Qwen3CoderParser(ToolParser):
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _FUNC = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        k = buf.find(self.CLOSE, start)
        return k + len(self.CLOSE) if k >= 0 else None

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.OPEN):]
        if body.endswith(self.CLOSE):
            body = body[: -len(self.CLOSE)]
        funcs = list(self._FUNC.finditer(body))
        if not funcs or self._FUNC.sub("", body).strip():
            return None
        calls = []
        for f in funcs:
            name = f.group(1).strip()
            props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
            params = list(self._PARAM.finditer(f.group(2)))
            if self._PARAM.sub("", f.group(2)).strip():
                return None
            args = {}
            for p in params:
                key = p.group(1).strip()
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = _typed(value, props.get(key))
            try:
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            except (TypeError, ValueError, RecursionError):
                return None
        return calls


class _JsonNames(ast.NodeTransformer):
    """JSON's ``true`` / ``false`` / ``null`` as Python's constants (models write both in pythonic calls)."""

    _VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self._VALUES:
            return ast.copy_location(ast.Constant(self._VALUES[node.id]), node)
        return node


def _json_names(node: ast.AST) -> ast.AST:
    return _JsonNames().visit(node)


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the type its schema names (strings stay text)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = types if isinstance(types, list) else [types] if types else []
    if "string" in types or not types and not isinstance(schema, dict):
        return value
    if value.strip() in ("null", "None") and ("null" in types or not types):
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        pass
    if "boolean" in types and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, RecursionError):
        return value


class HarmonyParser(ToolParser):
    """gpt-oss's harmony messages: ``[<|start|>assistant]<|channel|>CH[ to=functions.NAME][ <|constrain|>json]
    <|message|>BODY<|end|>|<|call|>|<|return|>``. analysis: reasoning; final (or commentary to no one):
    content; commentary (or any channel) to ``functions.NAME``: a call."""

    needs_special_tokens = True
    _ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    _HEAD_STARTS = ("<|start|>", "<|channel|>")

    def __init__(self, tools: list[dict] | None = None, calls: bool = True) -> None:
        super().__init__(tools, calls)
        self._head: str | None = None  # the open message's header (None: between messages)

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return self._run(final=False)

    def finish(self, truncated: bool = False) -> Parsed:
        out = self._run(final=True)
        rest = self._buf[self._pos:]
        if self._head is not None:
            out += self._body(self._head, rest, complete=not truncated)
        else:  # a header cut short: text, like anything that does not parse
            out.content += rest
        self._pos = len(self._buf)
        self._head = None
        return out

    def _run(self, final: bool) -> Parsed:
        out, buf = Parsed(), self._buf
        while True:
            if self._head is None:
                starts = [i for i in (buf.find(m, self._pos) for m in self._HEAD_STARTS) if i >= 0]
                if not starts:  # text outside any message: content
                    hold = 0 if final else _partial_suffix(buf[self._pos:], self._HEAD_STARTS)
                    out.content += buf[self._pos:len(buf) - hold]
                    self._pos = len(buf) - hold
                    return out
                s = min(starts)
                out.content += buf[self._pos:s]
                self._pos = s
                k = buf.find("<|message|>", s)
                if k < 0:
                    return out  # the header goes on
                self._head = buf[s:k]
                self._pos = k + len("<|message|>")
            ends = [(i, m) for m in self._ENDS if (i := buf.find(m, self._pos)) >= 0]
            if not ends:
                if self._recipient(self._head) is None:  # reasoning / content stream as they come
                    hold = 0 if final else _partial_suffix(buf[self._pos:], self._ENDS)
                    piece = buf[self._pos:len(buf) - hold]
                    out += self._body(self._head, piece, complete=True)
                    self._pos = len(buf) - hold
                return out
            i, m = min(ends)
            out += self._body(self._head, buf[self._pos:i], complete=True)
            self._pos = i if m == "<|start|>" else i + len(m)
            self._head = None

    @staticmethod
    def _recipient(head: str) -> str | None:
        m = re.search(r"to=functions\.([A-Za-z0-9_.\-]+)", head)
        return m.group(1) if m else None

    def _body(self, head: str, body: str, complete: bool) -> Parsed:
        name = self._recipient(head)
        ch = re.search(r"<\|channel\|>\s*(\w+)", head)
        channel = ch.group(1) if ch else "final"
        if name is not None and self.allow_calls:
            args = _args_text(body.strip()) if complete else None
            if args is None:
                return Parsed(content=body)
            return Parsed(calls=[ToolCall(name, args)])
        if channel == "analysis":
            return Parsed(reasoning=body)
        return Parsed(content=body)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "pythonic": PythonicParser, "qwen3_coder": Qwen3CoderParser, "harmony": HarmonyParser,
}


def make_parser(family: str, tools: list[dict] | None = None, calls: bool = True) -> ToolParser:
    return PARSERS[family](tools, calls)


def parse(family: str, text: str, tools: list[dict] | None = None, truncated: bool = False) -> Parsed:
    """The whole ``text`` parsed at once (the same as feeding it in any chunks, then finishing)."""
    p = make_parser(family, tools)
    out = p.feed(text)
    out += p.finish(truncated)
    return out


def family_of_template(source: str | None) -> str | None:
    """The format a chat template writes tool calls in, from its text; None if it names none."""
    if not source:
        return None
    if "<|channel|>" in source:
        return "harmony"
    if "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_start|>" in source or re.search(r"\[func_name1\(", source):
        return "pythonic"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "parameters" in source):
        return "llama3_json"
    return None
