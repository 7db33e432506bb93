"""What the handlers share: the engine, its step loop, the metrics, the chat template and the settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.runtime import Engine
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.vision import DEFAULT_MAX_PIXELS
from llmc.serve.chat import ChatTemplate
from llmc.serve.errors import APIError
from llmc.serve.loop import EngineLoop
from llmc.serve.metrics import Metrics
from llmc.serve.text import TokenStrings


@dataclass
class ServeConfig:
    """Server settings (``llmc serve`` flags)."""

    model_name: str
    api_key: str | None = None
    max_queue: int = 512  # waiting requests (choices) before new ones get 429
    max_body_size: int = 8 << 20  # bytes of a request body
    max_n: int = 16  # choices per request
    stall_timeout: float = 60.0  # /health turns 503 when one step runs longer than this (seconds)
    retry_after: int = 1  # seconds, in the Retry-After header of a 429
    drain_timeout: float = 30.0  # after SIGTERM: seconds running requests get to finish
    tool_call_parser: str | None = None  # None: from the chat template (serve/tool_parsers/), else hermes
    reasoning_parser: str | None = None  # None: reasoning stays in the content (serve/reasoning.py)
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (oldest evicted first)
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora)
    # Size mixed steps' prompt share for this inter-token latency (serve/itl.py); None: off.
    target_itl_ms: float | None = 100.0
    # Images in chat content parts (serve/images.py, serve/image_fetch.py).
    allowed_local_media_path: str | None = None  # file:// URLs and paths are read only under this directory
    allow_remote_images: bool = False  # http(s) image URLs fetched (--allow-remote-images); else a 400
    max_images_per_request: int = 4
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # width x height of one image, checked before it is decoded
    max_image_bytes: int = 20 << 20  # one image's encoded bytes (a remote or local file)
    image_fetch_timeout: float = 10.0  # seconds to fetch one remote image, all of it


@dataclass
class ServerState:
    engine: Engine
    config: ServeConfig
    loop: EngineLoop
    metrics: Metrics
    chat_template: ChatTemplate | None
    token_strings: TokenStrings | None
    draining: bool = False
    tool_family: str = "hermes"  # the tool-call format parsed and enforced (serve/tool_parsers/)
    created: int = field(default=0)  # unix time the server started (/v1/models)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise APIError(400, "prompt: this engine has no tokenizer.json; send token ids instead of text",
                           param="prompt", code="no_tokenizer")
        return self.engine.tokenizer

    @property
    def kv_pool_tokens(self) -> int:
        return self.loop.kv_pool_tokens  # one engine's pool (a replica's, behind --replicas)
