"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API (serve/responses.py) over the app's
response store (``app.state.llmc_responses``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmc.serve.errors import APIError
from llmc.serve.protocol import ResponsesRequest
from llmc.serve.responses import ResponseStore, create
from llmc.serve.routes.request_body import authorize, body_of, server_state

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    return request.app.state.llmc_responses


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    arrival = time.perf_counter()
    authorize(request)
    req, _ = await body_of(request, ResponsesRequest)
    return await create(server_state(request), _store(request), request, req, arrival)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    authorize(request)
    item = _store(request).get(response_id)
    if item is None:
        raise APIError(404, f"response_id: {response_id!r} is not stored here (store: false, or evicted)",
                       param="response_id", code="not_found")
    return item.response
