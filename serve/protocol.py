"""Request bodies of the OpenAI API, validated strictly: a wrong type is a 400, an unknown field is ignored.

Strict mode keeps ``"max_tokens": "16"`` from being read as 16 (OpenAI rejects it too); limits that
depend on the engine (context length, vocabulary, ``n``) are checked where the engine is known.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Logprobs alternatives returned per token: OpenAI's own cap on chat (top_logprobs <= 20).
MAX_TOP_LOGPROBS = 20

PositiveInt = Annotated[int, Field(ge=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM's convention)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: PositiveInt = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI fields llmc does not implement: accepted at their neutral values, refused otherwise (a silent
    # no-op would return something other than what was asked for).
    logit_bias: dict | None = None
    # Structured outputs (serve/structured.py): OpenAI's response_format, and vLLM's structured_outputs
    # for the kinds OpenAI has no field for (regex, choice, grammar).
    response_format: dict | None = None
    structured_outputs: dict | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None  # OpenAI's resolution hint: accepted and ignored (the processor decides)


class ImagePart(_Body):
    """``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (serve/images.py reads it)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    # Not strict as a whole: tool calls and names pass through to the template untouched.
    model_config = ConfigDict(extra="allow")
    role: Annotated[str, Field(strict=True, min_length=1)]
    content: Annotated[str, Field(strict=True)] | list[TextPart | ImagePart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    # Tool calling (serve/tools.py validates these itself, to name the failing part in OpenAI's words).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): a PEFT adapter directory, served under ``lora_name``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's optional id, accepted and unused


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(_Body):
    """POST /v1/responses (serve/responses.py turns it into a chat completion)."""

    model: str | None = None
    input: Any = None
    instructions: str | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None  # not OpenAI's: as on chat completions
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: dict | None = None
    metadata: dict | None = None
