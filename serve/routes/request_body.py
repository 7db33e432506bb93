"""What every API route does first: check the API key, read the body (size-limited), parse and validate it."""

from __future__ import annotations

import hmac
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from llmc.serve.errors import APIError, from_validation
from llmc.serve.state import ServerState


def server_state(request: Request) -> ServerState:
    """The state of the app serving ``request`` (set by serve/app.py's ``create_app``)."""
    return request.app.state.llmc


def authorize(request: Request) -> None:
    """401 unless the request carries ``--api-key`` as a bearer token (no key configured: every request passes)."""
    api_key = server_state(request).config.api_key
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # compare_digest takes the same time wherever the strings differ: the key cannot be guessed byte by byte.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        what = "missing" if not header else "incorrect"
        raise APIError(401, f"Authorization: {what} API key; send 'Authorization: Bearer <key>' with the key "
                       "given to llmc serve --api-key", code="invalid_api_key")


async def body_of(request: Request, model: type[BaseModel]) -> tuple[BaseModel, dict]:
    """The body validated as ``model``, and the decoded JSON object; 400 / 413 as OpenAI error objects."""
    raw = await read_body(request, server_state(request).config.max_body_size)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"body: not valid UTF-8 (byte {exc.start}: {exc.reason})", code="invalid_utf8") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"body: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
                       code="invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data), data
    except ValidationError as exc:
        raise from_validation(exc) from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) one over ``limit`` bytes before reading it when its length is declared."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"body: {int(declared)} bytes, the limit is {limit} (--max-body-size)",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"body: over {limit} bytes (--max-body-size)", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
