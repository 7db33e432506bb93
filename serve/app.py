"""The FastAPI application: routes, request bodies, API key, errors as OpenAI error objects."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmc.errors import LlmcError
from llmc.runtime import Engine
from llmc.serve import generate, responses
from llmc.serve.chat import ChatTemplate
from llmc.serve.errors import APIError, from_validation
from llmc.serve.loop import EngineLoop
from llmc.serve.metrics import Metrics
from llmc.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from llmc.serve.responses import ResponsesRequest, ResponseStore
from llmc.serve.state import ServeConfig, ServerState
from llmc.serve.text import TokenStrings
from llmc.serve.tool_parsers import family_of_template


def create_app(engine: Engine, config: ServeConfig, *, loop: EngineLoop | None = None) -> FastAPI:
    """An app serving ``engine``; its step loop starts and stops with the app's lifespan.

    ``loop``: what runs the requests instead of a step loop over ``engine`` here, with EngineLoop's interface
    (``llmc serve --replicas``: serve/replicas.py's RemoteLoop over Ray Serve replicas; ``engine`` then only
    needs the engine's metadata: tokenizer, vocabulary, context, EOS ids, path).
    """
    kv = engine.manifest.get("kv_cache", {})
    cache = {"block_size": str(engine.block_size), "cache_dtype": str(kv.get("dtype", "auto")),
             "enable_prefix_caching": str(getattr(getattr(engine, "config", None), "enable_prefix_caching", True))}
    metrics = Metrics(config.model_name, lambda: loop.snapshot, cache)
    if loop is None:
        loop = EngineLoop(engine, max_queue=config.max_queue, stall_timeout=config.stall_timeout, observer=metrics)
        if config.target_itl_ms is not None:
            from llmc.serve.itl import ItlGovernor

            loop.after_step.append(ItlGovernor(engine, config.target_itl_ms / 1000.0))
    else:
        loop.observer = metrics
    tok_config = engine.tokenizer.config if engine.tokenizer is not None else {}
    state = ServerState(engine=engine, config=config, loop=loop, metrics=metrics,
                        chat_template=ChatTemplate.from_engine(engine.path, tok_config),
                        token_strings=TokenStrings(engine.tokenizer) if engine.tokenizer is not None else None,
                        created=int(time.time()))

    template = state.chat_template
    state.tool_family = config.tool_call_parser or (
        family_of_template(template.source) if template is not None and template.takes_tools else None) or "hermes"
    log = logging.getLogger("llmc.serve")
    if state.chat_template is None:
        log.warning("%s has no chat template: /v1/chat/completions answers 400", engine.path)
    elif state.chat_template.error:
        log.warning("%s: the chat template does not compile (%s): /v1/chat/completions answers 400", engine.path,
                    state.chat_template.error)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="llmc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llmc = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's doing: still the error object, so clients report it instead of failing to parse.
        # (Starlette re-raises it after this response, and uvicorn logs the traceback.)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc} (a bug in llmc serve: please report it)",
                        code="internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown paths and methods answer in the same shape as everything else.
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code="not_found" if exc.status_code == 404 else None).response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest takes the same time wherever the strings differ: the key cannot be guessed byte by byte.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            what = "missing" if not header else "incorrect"
            raise APIError(401, f"Authorization: {what} API key; send 'Authorization: Bearer <key>' with the key "
                           "given to llmc serve --api-key", code="invalid_api_key")

    async def body_of(request: Request, model: type[BaseModel]) -> tuple[BaseModel, dict]:
        raw = await _read_body(request, config.max_body_size)
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        req, data = await body_of(request, CompletionRequest)
        return await generate.run(state, generate.plan_completion(state, req, data), request, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        req, data = await body_of(request, ChatCompletionRequest)
        return await generate.run(state, generate.plan_chat(state, req, data), request, arrival)

    store = ResponseStore(config.responses_store_size)
    app.state.llmc_responses = store

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        arrival = time.perf_counter()
        authorize(request)
        req, _ = await body_of(request, ResponsesRequest)
        return await responses.create(state, store, request, req, arrival)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        authorize(request)
        item = store.get(response_id)
        if item is None:
            raise APIError(404, f"response_id: {response_id!r} is not stored here (store: false, or evicted)",
                           param="response_id", code="not_found")
        return item.response

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        base = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "llmc",
                "root": str(engine.path), "parent": None, "max_model_len": engine.max_model_len}
        # LoRA adapters as vLLM lists them: parent = the base model, root = where the adapter was read from.
        adapters = [{**base, "id": name, "root": str(path), "parent": config.model_name}
                    for name, path in generate.lora_adapters(state).items()]
        return {"object": "list", "data": [base, *adapters]}

    if config.allow_runtime_lora:  # vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING); else 404
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            authorize(request)
            req, _ = await body_of(request, LoadLoraAdapterRequest)
            if req.lora_name == config.model_name or req.lora_name in generate.lora_adapters(state):
                raise APIError(400, f"lora_name: {req.lora_name!r} is already loaded; unload it first or pick "
                               "another name", param="lora_name", code="invalid_value")
            try:  # reads and checks the files: off the event loop, and behind the engine's lock (a step)
                await asyncio.to_thread(engine.add_lora, req.lora_name, req.lora_path)
            except LlmcError as exc:
                raise APIError(400, f"lora_path: {exc}", param="lora_path", code="invalid_value") from exc
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            authorize(request)
            req, _ = await body_of(request, UnloadLoraAdapterRequest)
            if req.lora_name not in generate.lora_adapters(state):
                raise APIError(404, f"lora_name: {req.lora_name!r} is not loaded", param="lora_name",
                               code="not_found")
            try:
                await asyncio.to_thread(engine.remove_lora, req.lora_name)
            except LlmcError as exc:  # requests for it are still running
                raise APIError(400, f"lora_name: {exc}", param="lora_name", code="invalid_value") from exc
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        authorize(request)
        req, _ = await body_of(request, TokenizeRequest)
        generate.check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = generate.chat_prompt_ids(state, req.messages, True, None)
        else:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        authorize(request)
        req, _ = await body_of(request, DetokenizeRequest)
        generate.check_model(state, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary (0..{engine.vocab_size - 1})",
                           param="tokens", code="invalid_token_id")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/health")
    async def health() -> Response:
        ok, why = loop.health()
        return Response(status_code=200) if ok else JSONResponse(APIError(503, f"unhealthy: {why}").body(), 503)

    @app.get("/ready")
    async def ready() -> Response:
        if state.draining:
            return JSONResponse(APIError(503, "draining: the server is shutting down").body(), 503)
        ok, why = loop.health()
        return Response(status_code=200) if ok else JSONResponse(APIError(503, f"not ready: {why}").body(), 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
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
