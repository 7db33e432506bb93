"""The app's exception handlers: every error, the client's or a bug, answers as an OpenAI error object."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.serve.errors import APIError


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    # A bug, not the client's doing: still the error object, so clients report it instead of failing to parse.
    # (Starlette re-raises it after this response, and uvicorn logs the traceback.)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc} (a bug in llmc serve: please report it)",
                    code="internal_error").response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown paths and methods answer in the same shape as everything else.
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    code="not_found" if exc.status_code == 404 else None).response()


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(Exception, _bug)
    app.add_exception_handler(StarletteHTTPException, _http_error)
