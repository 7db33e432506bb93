"""GET /health (the step loop runs), /ready (and the server is not draining) and /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmc.serve.errors import APIError
from llmc.serve.routes.request_body import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    ok, why = server_state(request).loop.health()
    return Response(status_code=200) if ok else JSONResponse(APIError(503, f"unhealthy: {why}").body(), 503)


@router.get("/ready")
async def ready(request: Request) -> Response:
    state = server_state(request)
    if state.draining:
        return JSONResponse(APIError(503, "draining: the server is shutting down").body(), 503)
    ok, why = state.loop.health()
    return Response(status_code=200) if ok else JSONResponse(APIError(503, f"not ready: {why}").body(), 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    return PlainTextResponse(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
