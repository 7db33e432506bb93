"""POST /v1/completions: text completion of a prompt (text or token ids)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmc.serve.generate import plan_completion, run
from llmc.serve.protocol import CompletionRequest
from llmc.serve.routes.request_body import authorize, body_of, server_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    arrival = time.perf_counter()
    authorize(request)
    req, data = await body_of(request, CompletionRequest)
    state = server_state(request)
    return await run(state, plan_completion(state, req, data), request, arrival)
