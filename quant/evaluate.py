"""Accuracy of a quantized engine against the unquantized one on held-out text.

Both engines score the same token windows (``Engine.score``: logits at every position). Reported:
perplexity of each (next-token negative log-likelihood), the perplexity increase in percent, the
mean KL divergence ``KL(p_ref || p_quant)`` of the next-token distributions, and top-1 agreement
(how often both engines' most likely next token is the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from llmc.errors import EXIT_ACCURACY_GATE, LlmcError

HELDOUT_SOURCE = "pydoc_data.topics, held-out split (llmc.testing.corpus)"


@dataclass
class Accuracy:
    """Figures over ``tokens`` scored positions (``windows`` sequences of at most ``window`` tokens)."""

    ppl_reference: float
    ppl: float
    ppl_increase_pct: float
    kl_mean: float
    top1_agreement: float
    tokens: int
    windows: int
    window: int
    text: str = HELDOUT_SOURCE

    def to_json(self) -> dict:
        # Rounded so the sealed report does not carry run-to-run noise in the last bits.
        out = asdict(self)
        for key in ("ppl_reference", "ppl", "ppl_increase_pct", "kl_mean", "top1_agreement"):
            out[key] = float(f"{out[key]:.6g}")
        return out

    def summary(self) -> str:
        return (f"perplexity {self.ppl:.4f} vs {self.ppl_reference:.4f} unquantized ({self.ppl_increase_pct:+.2f}%), "
                f"mean KL {self.kl_mean:.4g}, top-1 agreement {100 * self.top1_agreement:.2f}% "
                f"over {self.tokens} held-out tokens")


def heldout_windows(tokenizer_file: Path, window: int, max_tokens: int) -> list[list[int]]:
    """Token windows of at most ``window`` tokens (and at least 2) from the held-out pydoc documents,
    in document order, until ``max_tokens`` tokens are collected."""
    from tokenizers import Tokenizer

    from llmc.testing.corpus import pydoc_texts

    tok = Tokenizer.from_file(str(tokenizer_file))
    windows: list[list[int]] = []
    total = 0
    for text in pydoc_texts("heldout"):
        ids = tok.encode(text, add_special_tokens=False).ids
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            if len(chunk) < 2:
                continue
            windows.append(chunk)
            total += len(chunk)
            if total >= max_tokens:
                return windows
    return windows


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(reference, quantized, windows: list[list[int]], progress: Callable[[str], None] | None = None) -> Accuracy:
    """Score every window with both engines (anything with ``score(ids) -> [n, vocab]``); ``progress`` gets
    a line with an ETA after each tenth of the windows (a 1B model takes minutes here)."""
    nll_ref = nll_q = kl = 0.0
    agree = positions = predicted = 0
    total = sum(len(w) for w in windows)
    start = time.perf_counter()
    step = max(1, len(windows) // 10)
    for i, ids in enumerate(windows):
        if progress is not None and i and i % step == 0:
            elapsed = time.perf_counter() - start
            left = elapsed * (total - positions) / positions
            progress(f"      scored {positions}/{total} tokens, {elapsed:.0f}s elapsed, ETA {left:.0f}s")
        lr = _log_softmax(reference.score(ids))
        lq = _log_softmax(quantized.score(ids))
        targets = np.asarray(ids[1:])
        rows = np.arange(len(targets))
        nll_ref -= float(lr[rows, targets].sum())
        nll_q -= float(lq[rows, targets].sum())
        predicted += len(targets)
        kl += float((np.exp(lr) * (lr - lq)).sum())
        agree += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        positions += len(ids)
    if not predicted:
        raise LlmcError("accuracy evaluation: no held-out text to score (the tokenizer produced no windows)")
    ppl_ref = float(np.exp(nll_ref / predicted))
    ppl = float(np.exp(nll_q / predicted))
    return Accuracy(ppl_reference=ppl_ref, ppl=ppl, ppl_increase_pct=100.0 * (ppl / ppl_ref - 1.0),
                    kl_mean=kl / positions, top1_agreement=agree / positions, tokens=positions,
                    windows=len(windows), window=max(len(w) for w in windows))


def check_gate(accuracy: Accuracy, max_ppl_increase: float | None, recipe_name: str) -> None:
    """Raise (exit code 4) when the perplexity increase exceeds ``max_ppl_increase`` percent."""
    if max_ppl_increase is None or accuracy.ppl_increase_pct <= max_ppl_increase:
        return
    raise LlmcError(
        f"--max-ppl-increase {max_ppl_increase:g}%: {recipe_name} raises perplexity by "
        f"{accuracy.ppl_increase_pct:.2f}% ({accuracy.summary()}); no engine was written. Use a more accurate "
        "format or algorithm (int4-awq, int4-gptq, fp8, a smaller --group-size) or raise the limit",
        exit_code=EXIT_ACCURACY_GATE,
    )
