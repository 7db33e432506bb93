"""The FastAPI application: the server's state and step loop, the error handlers and the routes (serve/routes/)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from llmc.runtime import Engine
from llmc.serve.chat import ChatTemplate
from llmc.serve.loop import EngineLoop
from llmc.serve.metrics import Metrics
from llmc.serve.responses import ResponseStore
from llmc.serve.routes import chat, completions, health, lora, models, responses, tokens
from llmc.serve.routes import errors as error_handlers
from llmc.serve.state import ServeConfig, ServerState
from llmc.serve.text import TokenStrings
from llmc.serve.tool_parsers import family_of_template


def create_app(engine: Engine, config: ServeConfig, *, loop: EngineLoop | None = None) -> FastAPI:
    """An app serving ``engine``; its step loop starts and stops with the app's lifespan.

    ``loop``: what runs the requests instead of a step loop over ``engine`` here, with EngineLoop's interface
    (``llmc serve --replicas``: serve/replicas.py's RemoteLoop over Ray Serve replicas; ``engine`` then only
    needs the engine's metadata: tokenizer, vocabulary, context, EOS ids, path).
    """
    state = _server_state(engine, config, loop)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="llmc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llmc = state
    app.state.llmc_responses = ResponseStore(config.responses_store_size)
    error_handlers.install(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(models.router)
    if config.allow_runtime_lora:  # vLLM's runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING); else 404
        app.include_router(lora.router)
    app.include_router(tokens.router)
    app.include_router(health.router)
    return app


def _server_state(engine: Engine, config: ServeConfig, loop: EngineLoop | None) -> ServerState:
    """The state the routes share: the engine, its step loop (made here unless given) and metrics, the chat
    template and the tool-call family."""
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
    return state
