"""Chat templates: the engine's own Jinja template, rendered in jinja2's immutable sandbox.

The template comes from the artifact (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``), i.e. from whoever published the checkpoint: the sandbox keeps it from reaching
Python internals. The environment mirrors transformers' ``apply_chat_template`` (trim_blocks,
lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``, ``{% generation %}``) so a
conversation renders to the same text as there.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmc.serve.errors import APIError


class _Generation(Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks assistant spans with it): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    # Older tokenizer_config.json files spell special tokens as {"content": "<s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """The engine's chat template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._special = special_tokens
        self.source = source
        self.variables: set[str] = set()  # the context variables it reads (e.g. "tools")
        try:
            self._template: jinja2.Template | None = env.from_string(source)
            self.error: str | None = None
            self.variables = set(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.exceptions.TemplateSyntaxError as exc:  # the engine's file: completions still serve
            self._template = None
            self.error = f"line {exc.lineno}: {exc.message}"

    @property
    def takes_images(self) -> bool:
        """Whether the template places images itself: it compares a content part's type with ``'image'``
        (transformers' multimodal templates); else serve/images.py writes the image token into the text."""
        return re.search(r"""['"]image['"]""", self.source) is not None

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders ``tools`` itself (else serve/tools.py writes a generic system prompt)."""
        return "tools" in self.variables

    @classmethod
    def from_engine(cls, engine_dir: Path, tokenizer_config: dict) -> ChatTemplate | None:
        """The template of the engine at ``engine_dir``, or None if it has none (chat then answers 400)."""
        source: Any = None
        jinja_file = engine_dir / "chat_template.jinja"
        if jinja_file.is_file():
            source = jinja_file.read_text()
        else:
            source = tokenizer_config.get("chat_template")
            if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            return None
        special = {k: t for k, v in tokenizer_config.items() if k.endswith("_token") and (t := _token_text(v))}
        return cls(source, special)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        """The prompt text; a template that rejects the conversation (``raise_exception``) is a 400."""
        if self._template is None:
            raise APIError(400, f"messages: the engine's chat template does not compile ({self.error}); use "
                           "/v1/completions with a prompt", param="messages", code="bad_chat_template")
        context = {**self._special, **(extra or {}), "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except jinja2.exceptions.SecurityError as exc:
            raise APIError(400, f"messages: the chat template refused an unsafe operation ({exc})",
                           param="messages") from exc
        except jinja2.exceptions.TemplateError as exc:
            raise APIError(400, f"messages: the engine's chat template rejected them: {exc}",
                           param="messages") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # e.g. a None content concatenated
            raise APIError(400, f"messages: the engine's chat template failed on them ({type(exc).__name__}: "
                           f"{exc})", param="messages") from exc
