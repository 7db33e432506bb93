"""``llmc serve``: an OpenAI-compatible HTTP server for an llmc engine, with Prometheus metrics.

Imports the runtime only (never the compiler, never torch): a CPU engine serves where torch is absent.
"""

from llmc.serve.app import create_app
from llmc.serve.server import serve
from llmc.serve.state import ServeConfig

__all__ = ["ServeConfig", "create_app", "serve"]
