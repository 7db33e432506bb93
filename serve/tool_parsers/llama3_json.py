"""``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}`` (``;``-separated
for several), optionally after ``<|python_tag|>``."""

from __future__ import annotations

from llmc.serve.tool_parsers.base import ToolCall, ToolParser
from llmc.serve.tool_parsers.json_calls import calls_from_json
from llmc.serve.tool_parsers.scan import json_end, skip_ws


class Llama3JsonParser(ToolParser):
    markers = ("<|python_tag|>", "{")
    at_start = True

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = start
        if buf.startswith("<|python_tag|>", j):
            j += len("<|python_tag|>")
        j = skip_ws(buf, j)
        if j == len(buf):
            return None
        e = json_end(buf, j, self._scan)
        if e is None:
            return None
        return e if e != -1 else len(buf) if final else None

    def continue_after_region(self, buf: str, j: int, final: bool) -> int | None:
        if buf[j] != ";":
            return None
        k = skip_ws(buf, j + 1)
        if k == len(buf):
            return len(buf) if final else -1
        return k if buf[k] == "{" else None

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        return calls_from_json(body, ("parameters", "arguments"))
