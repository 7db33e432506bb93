"""Per-request sampling parameters and the sampler (numpy, float32 logits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.sampling.structured import StructuredOutputs


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. ``temperature == 0`` means greedy.

    Logits are processed in this order: ``repetition_penalty`` (Hugging Face semantics: every token
    already in the prompt or the output has its logit divided by the penalty when positive,
    multiplied when negative; 1 = off), ``presence_penalty`` / ``frequency_penalty`` (OpenAI semantics:
    every token already generated, not the prompt, has ``presence_penalty`` plus ``frequency_penalty``
    times its count subtracted from its logit; 0 = off), ``temperature``, ``top_k`` (``<= 0`` = off), ``top_p``
    (``1`` = off), ``min_p`` (drop tokens less likely than ``min_p`` times the most likely one;
    ``0`` = off). ``seed`` makes sampling reproducible per request.

    Stopping: ``max_tokens`` new tokens; the model's EOS (unless ``ignore_eos``); any of
    ``stop_token_ids`` (kept in the output); any of the ``stop`` strings (the text is cut before
    the stop string; the token ids keep the token that completed it). ``logprobs`` = N returns, per
    generated token, the log-probability of the chosen token and of the N most likely tokens under
    the model's distribution (before any processing); ``None`` returns none.

    ``structured`` (a :class:`~llmc.runtime.sampling.structured.StructuredOutputs`, or a dict of its fields)
    constrains the output to a JSON Schema, any JSON object, a regex, a choice or a grammar: tokens the
    constraint forbids are masked out before the steps above (logprobs stay the model's own).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    speculative: bool = True  # False: this request never speculates (when the engine has speculative decoding)
    structured: StructuredOutputs | None = None
    lora: str | None = None  # the name of a LoRA adapter the engine has loaded (None: the base model)

    def __post_init__(self) -> None:
        if self.structured is not None:
            self.structured = StructuredOutputs.coerce(self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise LlmcError(f"SamplingParams.max_tokens={self.max_tokens}: must be at least 1")
        if self.temperature < 0:
            raise LlmcError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise LlmcError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise LlmcError(f"SamplingParams.min_p={self.min_p}: must be in [0, 1] (0 = off)")
        if self.repetition_penalty <= 0:
            raise LlmcError(f"SamplingParams.repetition_penalty={self.repetition_penalty}: must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise LlmcError(f"SamplingParams.{name}={getattr(self, name)}: must be in [-2, 2] (0 = off)")
        if self.logprobs is not None and self.logprobs < 0:
            raise LlmcError(f"SamplingParams.logprobs={self.logprobs}: must be >= 0 (or None for none)")
        if any(not s for s in self.stop):
            raise LlmcError("SamplingParams.stop: stop strings must be non-empty")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise LlmcError(f"SamplingParams.lora={self.lora!r}: must be the name of a loaded LoRA adapter (a "
                            "non-empty string) or None for the base model")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens so far (a penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SampleRow:
    """One logits row for a sampler that runs where the logits are (:mod:`llmc.runtime.workers.cuda.sampler`):
    its index in the step's logits, its parameters, its history and, when sampled, its uniform in [0, 1)
    (drawn from the request's generator as :func:`sample` draws it)."""

    index: int
    params: SamplingParams
    context: Sequence[int] = ()  # prompt + output ids (read only when a penalty is on)
    prompt_len: int = 0
    uniform: float | None = None  # required when params.temperature > 0


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """Return a copy of ``logits`` ``[vocab]`` with every token of ``context`` penalised (HF semantics)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or not len(context):
        return out
    ids = np.unique(np.asarray(context, np.int64))
    seen = out[ids]
    out[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return out


def apply_presence_frequency_penalty(logits: np.ndarray, output: Sequence[int], presence: float,
                                     frequency: float) -> np.ndarray:
    """Return a copy of ``logits`` with ``presence + frequency * count`` subtracted for every token in ``output``."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if not len(output) or (presence == 0.0 and frequency == 0.0):
        return out
    ids, delta = presence_frequency_deltas(output, presence, frequency)
    out[ids] -= delta
    return out


def presence_frequency_deltas(output: Sequence[int], presence: float,
                              frequency: float) -> tuple[np.ndarray, np.ndarray]:
    """The ids in ``output`` and the float32 amounts ``presence + frequency * count`` to subtract from their
    logits (the device sampler subtracts the same numbers)."""
    ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
    return ids, np.float32(presence) + np.float32(frequency) * counts.astype(np.float32)


def apply_penalties(logits: np.ndarray, params: SamplingParams, context: Sequence[int] = (),
                    prompt_len: int = 0) -> np.ndarray:
    """``logits`` ``[vocab]`` with ``params``' penalties applied (a copy when any is on).

    ``context`` (prompt + output ids) feeds them: all of it the repetition penalty, the part after
    ``prompt_len`` (the output) the presence and frequency penalties.
    """
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, context, params.repetition_penalty)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        logits = apply_presence_frequency_penalty(logits, context[prompt_len:], params.presence_penalty,
                                                  params.frequency_penalty)
    return logits


def probabilities(logits: np.ndarray, params: SamplingParams, context: Sequence[int] = (),
                  prompt_len: int = 0) -> np.ndarray:
    """The distribution ``[vocab]`` (float64) :func:`sample` draws from at ``temperature > 0``: penalties,
    temperature, ``top_k``, ``top_p``, ``min_p``, in that order (speculative verification reads it too)."""
    scaled = apply_penalties(logits, params, context, prompt_len).astype(np.float64) / params.temperature
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
    if params.min_p > 0.0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           context: Sequence[int] = (), prompt_len: int = 0) -> int:
    """Pick one token id from ``logits`` ``[vocab]`` (``context``, ``prompt_len``: see :func:`apply_penalties`)."""
    if params.temperature == 0:
        return int(np.argmax(apply_penalties(logits, params, context, prompt_len)))
    probs = probabilities(logits, params, context, prompt_len)
    return int(rng.choice(probs.size, p=probs))


def token_logprobs(logits: np.ndarray, token: int, top: int) -> dict[int, float]:
    """Log-probabilities under ``softmax(logits)``: of ``token`` and of the ``top`` most likely ids."""
    x = logits.astype(np.float64)
    m = x.max()
    logz = m + np.log(np.exp(x - m).sum())
    out: dict[int, float] = {}
    if top > 0:
        ids = np.argpartition(-x, min(top, x.size) - 1)[:top]
        for i in ids[np.argsort(-x[ids], kind="stable")]:
            out[int(i)] = float(x[i] - logz)
    out[int(token)] = float(x[token] - logz)
    return out
