"""``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``."""

from __future__ import annotations

import re

from llmc.serve.tool_parsers.base import ToolCall, ToolParser
from llmc.serve.tool_parsers.json_calls import args_text, calls_from_json
from llmc.serve.tool_parsers.scan import json_end, skip_ws


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    OPEN = "[TOOL_CALLS]"

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = skip_ws(buf, start + len(self.OPEN))
        if j == len(buf):
            return None
        if buf[j] in "[{":
            return json_end(buf, j, self._scan)
        k = buf.find("[ARGS]", j)  # name[ARGS]{...}
        if k < 0:
            return len(buf) if final else None
        a = skip_ws(buf, k + len("[ARGS]"))
        if a == len(buf):
            return None
        e = json_end(buf, a, self._scan)
        return e if e != -1 else (len(buf) if final else None)

    def parse_region(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.OPEN):].strip()
        if body[:1] in ("[", "{"):
            return calls_from_json(body)
        name, sep, args = body.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            return None
        a = args_text(args.strip())
        return None if a is None else [ToolCall(name, a)]
