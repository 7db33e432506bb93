"""``hermes`` (Hermes, Qwen2.5/Qwen3, llmc's default model):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

from llmc.serve.tool_parsers.base import ToolCall, ToolParser
from llmc.serve.tool_parsers.json_calls import calls_from_json
from llmc.serve.tool_parsers.scan import json_end, skip_ws


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = skip_ws(buf, start + len(self.OPEN))
        if j == len(buf):
            return None
        e = json_end(buf, j, self._scan)
        if e is None:
            return None
        if e == -1:  # not JSON: up to the closing tag, content
            k = buf.find(self.CLOSE, j)
            return k + len(self.CLOSE) if k >= 0 else None
        k = skip_ws(buf, e)
        if buf.startswith(self.CLOSE, k):
            return k + len(self.CLOSE)
        if not final and self.CLOSE.startswith(buf[k:]):
            return None  # the closing tag may be arriving
        return e  # a complete call without its closing tag

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.OPEN):].strip()
        if body.endswith(self.CLOSE):
            body = body[: -len(self.CLOSE)].strip()
        return calls_from_json(body)
