"""The tool-call families by name (``--tool-call-parser``), the whole-text parse, and the family a chat template
writes its calls in."""

from __future__ import annotations

import re

from llmc.serve.tool_parsers.base import Parsed, ToolParser
from llmc.serve.tool_parsers.harmony import HarmonyParser
from llmc.serve.tool_parsers.hermes import HermesParser
from llmc.serve.tool_parsers.llama3_json import Llama3JsonParser
from llmc.serve.tool_parsers.mistral import MistralParser
from llmc.serve.tool_parsers.pythonic import PythonicParser
from llmc.serve.tool_parsers.qwen3_coder import Qwen3CoderParser

FAMILIES = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "harmony")

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "pythonic": PythonicParser, "qwen3_coder": Qwen3CoderParser, "harmony": HarmonyParser,
}


def make_parser(family: str, tools: list[dict] | None = None, calls: bool = True) -> ToolParser:
    """A fresh streaming parser of ``family``; ``tools``: the request's tools (types for qwen3_coder's values);
    ``calls``: False when no tools were offered (a call is then only text)."""
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
