"""Calls written as JSON (``{"name": ..., "arguments": {...}}``, or a list of them), as :class:`ToolCall`."""

from __future__ import annotations

import json
from typing import Any

from llmc.serve.tool_parsers.base import ToolCall


def args_text(value: Any) -> str | None:
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


def call_from_obj(obj: Any, args_keys=("arguments", "parameters")) -> ToolCall | None:
    """One decoded call object as a call (arguments under the first of ``args_keys`` present); None if not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        return call_from_obj(obj["function"], args_keys)
    raw = next((obj[k] for k in args_keys if k in obj), {})
    args = args_text(raw)
    return None if args is None else ToolCall(obj["name"], args)


def calls_from_json(text: str, args_keys=("arguments", "parameters")) -> list[ToolCall] | None:
    """The calls of a JSON call object or array of them; None if ``text`` is not that (all or nothing)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = [call_from_obj(v, args_keys) for v in items]
    return None if any(c is None for c in calls) else calls
