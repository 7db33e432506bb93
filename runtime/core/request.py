"""A generation request and its progress: the unit the scheduler schedules and the engine steps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from llmc.runtime.sampling.sampler import SamplingParams

if TYPE_CHECKING:
    from llmc.runtime.speculative.state import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress. ``tokens`` holds the prompt, then the output."""

    request_id: str
    seq_id: int
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    arrival_time: float
    rng: np.random.Generator
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at the first admission
    admitted_len: int = 0  # len(tokens) at the latest admission: its KV's rotary factors follow from it
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str | None = None  # detokenised output, kept up to date only when stop strings need it
    _hashes: tuple[int, list[int]] | None = None  # (len(tokens), chained hashes of the cacheable blocks)
    # Speculative decoding: drafts proposed for the next step (consumed by schedule()), the draft's
    # distributions ``[len(draft), vocab]`` (None: point masses), and the per-request state (None: off).
    draft: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None
    spec: SpecState | None = None
    # Multi-LoRA: the slot this request's adapter occupies while it runs (0: the base model), and the adapter's
    # key, which roots its blocks' hash chain so that the prefix cache never mixes adapters' KV.
    lora_slot: int = 0
    lora_key: int = 0
    # Images (llmc.runtime.image_inputs): each image's span of tokens and its features, and the key of its images'
    # content, which roots the blocks' hash chain beside the adapter's (other images: other blocks).
    image_spans: list | None = None
    image_key: int = 0
    # M-RoPE engines (llmc.runtime.mrope): the prompt's [3, prompt_len] positions, and the offset of every later
    # token's position from its index; None / 0: the request's tokens sit at their indices.
    image_positions: np.ndarray | None = None
    position_delta: int = 0
    # Token ranges [start, end) no prefill chunk may end inside (a bidirectional engine's images: each image token
    # sees its image's later tokens, which must be written in the same step); None: chunks end anywhere.
    atomic_spans: list[tuple[int, int]] | None = None

    @property
    def cache_root(self) -> int:
        """The root of this request's prefix-cache hash chain: its adapter's key, mixed with its images' key."""
        if not self.image_key:
            return self.lora_key
        return ((self.lora_key * 0x9E3779B97F4A7C15) ^ self.image_key) & ((1 << 63) - 1) or 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_remaining(self) -> int:
        """Known tokens whose KV still has to be computed (1 while decoding)."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
