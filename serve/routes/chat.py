"""POST /v1/chat/completions: a chat answer through the engine's chat template (tools, reasoning, structure)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmc.serve.generate import plan_chat, run
from llmc.serve.protocol import ChatCompletionRequest
from llmc.serve.routes.request_body import authorize, body_of, server_state

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    arrival = time.perf_counter()
    authorize(request)
    req, data = await body_of(request, ChatCompletionRequest)
    state = server_state(request)
    return await run(state, plan_chat(state, req, data), request, arrival)
