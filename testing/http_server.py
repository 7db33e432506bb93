"""Run ``llmc serve``'s app on a real socket (127.0.0.1, a free port) in a background thread, for tests."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from llmc.runtime import Engine
from llmc.serve import ServeConfig, create_app
from llmc.serve.server import _event_loop, _Server
from llmc.serve.state import ServerState


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    state: ServerState
    server: _Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def terminate(self) -> None:
        """What SIGTERM does to ``llmc serve`` (uvicorn's handler): drain, then stop. Returns at once."""
        self.server.handle_exit(signal.SIGTERM, None)


@contextmanager
def serve_in_thread(engine: Engine, config: ServeConfig) -> Iterator[RunningServer]:
    """The app on a real HTTP server (uvicorn, the same loop and parser as ``llmc serve``) until the block ends."""
    with serve_app_in_thread(create_app(engine, config), config) as running:
        yield running


@contextmanager
def serve_app_in_thread(app, config: ServeConfig) -> Iterator[RunningServer]:
    """As :func:`serve_in_thread`, for an app already made (``llmc serve --replicas``' front: serve/replicas.py)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    state: ServerState = app.state.llmc
    server = _Server(uvicorn.Config(app, loop=_event_loop(), http="httptools", log_level="warning",
                                    timeout_graceful_shutdown=config.drain_timeout), state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", state, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
