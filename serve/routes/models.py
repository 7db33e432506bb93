"""GET /v1/models: the served model and its LoRA adapters, as vLLM lists them."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmc.serve.generate import lora_adapters
from llmc.serve.routes.request_body import authorize, server_state

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    authorize(request)
    state = server_state(request)
    config, engine = state.config, state.engine
    base = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "llmc",
            "root": str(engine.path), "parent": None, "max_model_len": engine.max_model_len}
    # LoRA adapters as vLLM lists them: parent = the base model, root = where the adapter was read from.
    adapters = [{**base, "id": name, "root": str(path), "parent": config.model_name}
                for name, path in lora_adapters(state).items()]
    return {"object": "list", "data": [base, *adapters]}
