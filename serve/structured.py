"""Structured outputs in the HTTP API: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
- ``structured_outputs`` (an extra body field, vLLM's names): exactly one of ``{"json": schema}``,
  ``{"json_object": true}``, ``{"regex": "..."}``, ``{"choice": ["a", "b"]}``, ``{"grammar": "..."}``;
  optional ``"whitespace_flexible": true`` for the JSON kinds.

The constraint is compiled before the request reaches the step loop (in a worker thread, bounded by
``StructuredConfig.compile_timeout_s``), so an invalid or over-limit one is a 400 naming the field and
no token is generated; the engine then finds it in its cache.
"""

from __future__ import annotations

import asyncio

from llmc.errors import LlmcError
from llmc.runtime.sampling.structured import KINDS, StructuredOutputs
from llmc.serve.errors import APIError


def requested(response_format: dict | None, structured_outputs: dict | None) -> tuple[StructuredOutputs | None, str]:
    """The constraint a request asks for and the request field it came from; 400 for a malformed one."""
    spec, where = None, "response_format"
    if response_format is not None:
        spec = _from_response_format(response_format)
    if structured_outputs is not None:
        if spec is not None:
            raise APIError(400, "structured_outputs: give either response_format or structured_outputs, not both",
                           param="structured_outputs", code="invalid_value")
        where = "structured_outputs"
        if not isinstance(structured_outputs, dict):
            raise APIError(400, "structured_outputs: must be an object with one of " + ", ".join(KINDS),
                           param=where, code="invalid_value")
        try:
            spec = StructuredOutputs.coerce(structured_outputs)
        except LlmcError as exc:
            raise APIError(400, f"{where}: {_tail(exc)}", param=where, code="invalid_value") from exc
    return spec, where


def _from_response_format(rf: dict) -> StructuredOutputs | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, "response_format.json_schema: must be an object with a \"schema\" (a JSON Schema), "
                           "e.g. {\"name\": \"x\", \"schema\": {\"type\": \"object\"}}",
                           param="response_format", code="invalid_value")
        schema = js["schema"]
        if not isinstance(schema, dict):
            raise APIError(400, f"response_format.json_schema.schema: must be a JSON Schema object (got "
                           f"{type(schema).__name__})", param="response_format", code="invalid_value")
        # "strict" is accepted either way: the schema is always enforced (never best effort).
        return StructuredOutputs(json=schema)
    raise APIError(400, f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                   param="response_format", code="invalid_value")


def _tail(exc: LlmcError) -> str:
    # The runtime names its own fields ("structured.json: ..."); the client sent the request's field.
    msg = str(exc)
    if msg.startswith(("structured.", "structured:", "StructuredOutputs:")):
        return msg.split(": ", 1)[-1]
    return msg.removeprefix("StructuredOutputs.")


async def precompile(engine, spec: StructuredOutputs, where: str) -> None:
    """Compile ``spec`` off the event loop and the step loop; 400 naming ``where`` if it is refused."""
    try:
        await asyncio.to_thread(lambda: engine.structured.compiler.compile(spec))
    except LlmcError as exc:
        if where == "tools":  # the grammar made from the tools' schemas (serve/tools.py)
            field_name = "tools"
        elif where == "response_format":
            field_name = "response_format.json_schema.schema" if spec.kind == "json" else where
        else:
            field_name = f"{where}.{spec.kind}"
        raise APIError(400, f"{field_name}: {_tail(exc)}", param=where, code="invalid_value") from exc
