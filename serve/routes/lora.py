"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA routes
(VLLM_ALLOW_RUNTIME_LORA_UPDATING), included only with ``--allow-runtime-lora`` (else 404)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from llmc.errors import LlmcError
from llmc.serve.errors import APIError
from llmc.serve.generate import lora_adapters
from llmc.serve.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from llmc.serve.routes.request_body import authorize, body_of, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    authorize(request)
    req, _ = await body_of(request, LoadLoraAdapterRequest)
    state = server_state(request)
    if req.lora_name == state.config.model_name or req.lora_name in lora_adapters(state):
        raise APIError(400, f"lora_name: {req.lora_name!r} is already loaded; unload it first or pick "
                       "another name", param="lora_name", code="invalid_value")
    try:  # reads and checks the files: off the event loop, and behind the engine's lock (a step)
        await asyncio.to_thread(state.engine.add_lora, req.lora_name, req.lora_path)
    except LlmcError as exc:
        raise APIError(400, f"lora_path: {exc}", param="lora_path", code="invalid_value") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    authorize(request)
    req, _ = await body_of(request, UnloadLoraAdapterRequest)
    state = server_state(request)
    if req.lora_name not in lora_adapters(state):
        raise APIError(404, f"lora_name: {req.lora_name!r} is not loaded", param="lora_name",
                       code="not_found")
    try:
        await asyncio.to_thread(state.engine.remove_lora, req.lora_name)
    except LlmcError as exc:  # requests for it are still running
        raise APIError(400, f"lora_name: {exc}", param="lora_name", code="invalid_value") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
