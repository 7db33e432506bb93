"""``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>``;
the ``analysis`` channel is reasoning, ``final`` the content."""

from __future__ import annotations

import re

from llmc.serve.tool_parsers.base import Parsed, ToolCall, ToolParser
from llmc.serve.tool_parsers.json_calls import args_text
from llmc.serve.tool_parsers.scan import partial_suffix


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
                    hold = 0 if final else partial_suffix(buf[self._pos:], self._HEAD_STARTS)
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
                    hold = 0 if final else partial_suffix(buf[self._pos:], self._ENDS)
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
            args = args_text(body.strip()) if complete else None
            if args is None:
                return Parsed(content=body)
            return Parsed(calls=[ToolCall(name, args)])
        if channel == "analysis":
            return Parsed(reasoning=body)
        return Parsed(content=body)
