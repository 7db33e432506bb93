"""Tool-call parsers, one per format family (one module each), usable on a whole text or fed a stream in chunks.

A parser turns the model's answer text into content (the text that is not a call), calls (name and
arguments as JSON text) and, for gpt-oss's harmony format, reasoning. Every parser is a streaming
parser: :meth:`ToolParser.feed` takes the next piece of text and returns what became certain,
:meth:`ToolParser.finish` the rest; :func:`parse` is ``feed(whole text)`` then ``finish()``, so a
stream and a whole text give the same calls by construction, however the text was cut.

A call is returned once its text is complete and parses (a stream never announces a call that the
whole text would not have); text that looks like a call but does not parse is returned as content,
never an error. Content that may be the beginning of a call marker is held back until it is known.

Families (``--tool-call-parser``), one module each:

- ``hermes`` (Hermes, Qwen2.5/Qwen3, llmc's default model):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}`` (``;``-separated for
  several), optionally after ``<|python_tag|>``
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}``
- ``pythonic`` (Llama 3.2/4, Pythonic models): the answer is ``[f(a=1, b="x"), g()]``
- ``qwen3_coder``: ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>``;
  the ``analysis`` channel is reasoning, ``final`` the content.

Modules: ``base`` (``ToolCall``, ``Parsed``, the streaming ``ToolParser``), ``scan`` (where JSON / Python values
end, markers held back), ``json_calls`` (JSON call objects as calls), one module per family, ``registry``
(families by name, :func:`parse`, :func:`family_of_template`).
"""

from llmc.serve.tool_parsers.base import Parsed, ToolCall, ToolParser
from llmc.serve.tool_parsers.registry import FAMILIES, PARSERS, family_of_template, make_parser, parse
from llmc.serve.tool_parsers.scan import json_end

__all__ = ["FAMILIES", "PARSERS", "Parsed", "ToolCall", "ToolParser", "family_of_template", "json_end", "make_parser",
           "parse"]
