"""How an engine speculates: :class:`SpeculativeConfig`, given to ``Engine.load`` (``speculative=``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmc.errors import LlmcError

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """How an engine speculates. ``num_tokens`` is the most draft tokens per request per step.

    ``method="ngram"`` (prompt lookup): the draft is what followed the latest earlier occurrence of
    the sequence's last n-gram, for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.
    ``method="draft"``: ``draft_model`` is an llmc CPU engine with the target's vocabulary (a smaller
    model trained with the same tokenizer), loaded beside the target with ``draft_kv_cache_tokens`` of
    KV pool of its own (default: the target's). With ``adaptive`` (default) each request's number of
    drafts follows its acceptance rate and the measured cost of a step's extra tokens (0 when it does
    not pay); without it every step proposes ``num_tokens`` when it can.
    """

    method: str = "ngram"
    num_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: str | Path | None = None
    draft_kv_cache_tokens: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise LlmcError(f"SpeculativeConfig.method={self.method!r}: must be one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= 32:
            raise LlmcError(f"SpeculativeConfig.num_tokens={self.num_tokens}: must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise LlmcError(f"SpeculativeConfig.prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                            f"{self.prompt_lookup_max}: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and self.draft_model is None:
            raise LlmcError("SpeculativeConfig.draft_model: method 'draft' needs the path of a draft llmc engine "
                            "(llmc build SMALL_CHECKPOINT -o DRAFT), or use method 'ngram'")
        if self.method == "ngram" and self.draft_model is not None:
            raise LlmcError("SpeculativeConfig.draft_model is set but method is 'ngram'; use method='draft'")

    @classmethod
    def parse(cls, spec: str, num_tokens: int = 4) -> SpeculativeConfig:
        """``"ngram"`` or ``"draft:PATH"`` (the ``--speculative`` option of ``llmc bench`` / ``llmc serve``)."""
        if spec == "ngram":
            return cls("ngram", num_tokens)
        if spec.startswith("draft:") and len(spec) > len("draft:"):
            return cls("draft", num_tokens, draft_model=spec[len("draft:"):])
        raise LlmcError(f"--speculative {spec!r}: must be 'ngram' or 'draft:PATH' (PATH: a draft llmc engine)")
