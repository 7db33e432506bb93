"""Run the app under uvicorn: one engine per process, SIGTERM drains, exit 0."""

from __future__ import annotations

import logging
import signal
import socket
from types import FrameType

import uvicorn

from llmc.runtime import Engine
from llmc.serve.app import create_app
from llmc.serve.state import ServeConfig, ServerState


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown starts so /ready turns 503 while it drains."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._llmc_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._llmc_state.draining = True
        super().handle_exit(sig, frame)


def _event_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # optional: asyncio's own loop serves too, a little slower
        return "asyncio"
    return "uvloop"


def serve(engine: Engine, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, log_level: str = "info") -> None:
    """Serve ``engine`` until SIGTERM / SIGINT; returns after running requests finished or ``drain_timeout``."""
    serve_app(create_app(engine, config), config, host=host, port=port, sock=sock, log_level=log_level)


def serve_app(app, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000,
              sock: socket.socket | None = None, log_level: str = "info") -> None:
    """Serve an app made by ``create_app`` (one engine, or replicas' front: serve/replicas.py) as :func:`serve`."""
    state: ServerState = app.state.llmc
    uv_config = uvicorn.Config(app, host=host, port=port, loop=_event_loop(), http="httptools", log_level=log_level,
                               timeout_graceful_shutdown=config.drain_timeout, access_log=False,
                               # Streams can pause for a whole long prefill; no keep-alive cut mid-request.
                               timeout_keep_alive=30)
    server = _Server(uv_config, state)
    # uvicorn re-raises the signal that stopped it once it is done, to run the previous handler: make that
    # handler a no-op, so a drained SIGTERM ends the process with status 0 rather than killed by the signal.
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drained(sig: int, frame: FrameType | None) -> None:
    logging.getLogger("llmc.serve").info("drained after signal %d; exiting", sig)
