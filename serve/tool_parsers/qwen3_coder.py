"""``qwen3_coder``: ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``; each
parameter's text is read as the type the tool's schema gives it."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from llmc.serve.tool_parsers.base import ToolCall, ToolParser


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
