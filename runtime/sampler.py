"""Per-request sampling parameters and the sampler (numpy, float32 logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError


@dataclass
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy.

    ``top_k <= 0`` and ``top_p >= 1`` disable those filters. ``stop_token_ids`` end the request
    (in addition to the model's EOS unless ``ignore_eos``); the stop token is kept in the output.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise LlmcError(f"SamplingParams.max_tokens={self.max_tokens}: must be at least 1")
        if self.temperature < 0:
            raise LlmcError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise LlmcError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from ``logits`` ``[vocab]``."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k > 0 and params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(probs.size, p=probs))
