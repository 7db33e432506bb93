"""The HTTP routes of ``llmc serve``, one module per concern, each an ``APIRouter`` that serve/app.py includes.

``request_body`` (API key, body reading and validation, shared by all), ``completions``, ``chat``,
``responses``, ``models``, ``lora`` (runtime adapters, only with ``--allow-runtime-lora``), ``tokens``
(tokenize, detokenize), ``health`` (health, readiness, Prometheus metrics), ``errors`` (every error as an
OpenAI error object). A handler reads the server's state from ``request.app.state.llmc`` (serve/state.py
``ServerState``).
"""
