"""What the engine returns: finished requests (:class:`GenerationOutput`), per-step outputs
(:class:`RequestOutput`), streamed tokens (:class:`StreamEvent`) and a snapshot of the engine (:class:`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationOutput:
    """One finished request. Times in seconds from submission; ``ttft`` is time to first token.

    ``logprobs`` (when requested) has one ``{token_id: logprob}`` per output token, holding the
    chosen token and the requested number of most likely ones.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    ttft: float = 0.0
    latency: float = 0.0
    request_id: str = ""
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Structured outputs (SamplingParams.structured): the output stopped before its structure was
    # complete (by max_tokens, a stop string, cancellation), or the constraint failed (then why).
    structured_incomplete: bool = False
    structured_error: str | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token (if any) and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None


@dataclass
class StreamEvent:
    """One streamed token of request ``index`` (position in the prompts given to stream()).

    The last event of a request has ``finished`` set (a cancelled request's last event carries
    no token). ``text`` is the new text this token adds (``None`` without a tokenizer).
    """

    index: int
    request_id: str
    token_id: int | None
    text: str | None
    logprobs: dict[int, float] | None
    finished: bool
    finish_reason: str | None


@dataclass
class EngineStats:
    """A snapshot of the engine. Block counts are KV blocks of ``block_size`` tokens."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int  # free plus cached-but-unused (evictable) blocks
    kv_blocks_cached: int  # blocks registered in the prefix cache
    prefix_cache_hit_rate: float  # hit blocks / looked-up full prompt blocks
    cached_prompt_tokens: int  # prompt tokens served by the prefix cache
    prompt_tokens_computed: int
    recomputed_tokens: int
    generated_tokens: int
    num_preemptions: int
    num_steps: int
    busy_seconds: float  # time spent in steps
    tokens_per_s: float  # generated tokens per busy second
    # Speculative decoding (zeros without it): draft tokens verified, of which accepted, verify chunks;
    # acceptance rate = accepted / draft; mean accepted length = accepted / verify chunks (the target's own
    # token per chunk not counted); draft_seconds = time in the draft model's steps.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_draft_seconds: float = 0.0
    # Multi-LoRA engines: adapters that running requests use, adapters that waiting requests ask for, and the
    # engine's slots (0: no LoRA); vLLM's lora_requests_info gauge reports them.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Hybrid models (recurrent layers): per-sequence state slots beside the KV blocks, and their memory.
    state_slots_total: int = 0
    state_slots_used: int = 0
    state_bytes: int = 0
    # Why prefix caching is off although it was asked for ("" when it is on or was turned off by the caller).
    prefix_caching_disabled_reason: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)
