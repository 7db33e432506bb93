"""``pythonic`` (Llama 3.2/4, Pythonic models): the answer is ``[f(a=1, b="x"), g()]``."""

from __future__ import annotations

import ast
import json

from llmc.serve.tool_parsers.base import ToolCall, ToolParser
from llmc.serve.tool_parsers.scan import python_end, skip_ws


class PythonicParser(ToolParser):
    markers = ("<|python_start|>", "[")
    at_start = True

    def region_end(self, buf: str, start: int, final: bool) -> int | None:
        j = start
        if buf.startswith("<|python_start|>", j):
            j = skip_ws(buf, j + len("<|python_start|>"))
        if j == len(buf):
            return None
        e = python_end(buf, j)
        if e is None:
            return None
        if e == -1:
            return len(buf) if final else None
        k = skip_ws(buf, e)
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


class _JsonNames(ast.NodeTransformer):
    """JSON's ``true`` / ``false`` / ``null`` as Python's constants (models write both in pythonic calls)."""

    _VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self._VALUES:
            return ast.copy_location(ast.Constant(self._VALUES[node.id]), node)
        return node


def _json_names(node: ast.AST) -> ast.AST:
    return _JsonNames().visit(node)
