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

# Sealed into every quantized engine's report: the wording (which names the corpus's module before it moved to
# llmc.quant.corpus) stays, so that the same build gives the same bytes.
HELDOUT_SOURCE = "pydoc_data.topics, held-out split (llmc.testing.corpus)"


@dataclass
class Accuracy:
    """Figures over ``tokens`` scored positions (``windows`` sequences of at most ``window`` tokens).
    ``ppl_increase_ci95`` is the half-width of the perplexity increase's 95 % confidence interval in percentage
    points (windows as clusters: tokens within one are not independent); ``stopped`` says why scoring ended:
    ``"precision"`` (the interval reached :data:`PPL_CI95_TARGET`), ``"limit"`` (the token limit) or
    ``"text"`` (the held-out text ran out)."""

    ppl_reference: float
    ppl: float
    ppl_increase_pct: float
    kl_mean: float
    top1_agreement: float
    tokens: int
    windows: int
    window: int
    text: str = HELDOUT_SOURCE
    ppl_increase_ci95: float | None = None
    stopped: str | None = None
    reference_cached: bool = False
    scored: str | None = None  # which engine the figures are of (QuantStage.evaluate fills it in)

    def to_json(self) -> dict:
        # Rounded so the sealed report does not carry run-to-run noise in the last bits.
        out = asdict(self)
        for key in ("ppl_reference", "ppl", "ppl_increase_pct", "kl_mean", "top1_agreement", "ppl_increase_ci95"):
            if out[key] is not None:
                out[key] = float(f"{out[key]:.6g}")
        return out

    def summary(self) -> str:
        ci = f" ± {self.ppl_increase_ci95:.2f}" if self.ppl_increase_ci95 is not None else ""
        return (f"perplexity {self.ppl:.4f} vs {self.ppl_reference:.4f} unquantized "
                f"({self.ppl_increase_pct:+.2f}%{ci}), "
                f"mean KL {self.kl_mean:.4g}, top-1 agreement {100 * self.top1_agreement:.2f}% "
                f"over {self.tokens} held-out tokens")


@dataclass
class Precision:
    """When to stop scoring: after at least ``min_tokens``, once the 95 % interval of the perplexity increase is
    at most ``ppl_ci95`` percentage points wide on each side; never beyond ``max_tokens``."""

    min_tokens: int = 2048
    # A model whose quantized next-token distributions move a lot per token while its mean barely moves (the
    # random-weight 1B peers checkpoint: KL 0.2) never reaches the target; past 4096 tokens the report states
    # the interval it got instead (7781 held-out tokens cost that model's build 110 s of its 206).
    max_tokens: int = 4096
    ppl_ci95: float = 0.25


# The perplexity increase is reported to a quarter of a percentage point (95 %): finer than any
# --max-ppl-increase gate worth setting, and what a few thousand tokens give a good INT4 model.
PPL_CI95_TARGET = Precision().ppl_ci95


def heldout_windows(tokenizer_file: Path, window: int, max_tokens: int) -> list[list[int]]:
    """Token windows of at most ``window`` tokens (and at least 2) from the held-out pydoc documents,
    in document order, until ``max_tokens`` tokens are collected."""
    from tokenizers import Tokenizer

    from llmc.quant.corpus import pydoc_texts

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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 ``[n, vocab]`` log-probabilities (computed in float64)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def _ci95(sums: list[float], counts: list[int], mean: float) -> float:
    """Half-width of the 95 % interval of a mean over windows of correlated tokens (the cluster-robust standard
    error of a ratio estimate), in the units of ``mean``."""
    w = len(sums)
    if w < 2:
        return float("inf")
    resid = np.asarray(sums) - mean * np.asarray(counts, np.float64)
    return 1.96 * float(np.sqrt(w / (w - 1) * (resid**2).sum())) / float(sum(counts))


def compare(reference: Callable[[int, list[int]], np.ndarray], quantized, windows: list[list[int]],
            progress: Callable[[str], None] | None = None, precision: Precision | None = None) -> Accuracy:
    """Score windows with both engines until ``precision`` is met (all of them when None). ``reference(i, ids)``
    gives the unquantized engine's float32 log-probabilities ``[len(ids), vocab]`` of window ``i`` (from a cache
    or a scorer); ``quantized(i, ids)`` gives the quantized engine's logits ``[len(ids), vocab]``. ``progress``
    gets a line with an ETA after each tenth of the windows (a 1B model takes minutes here)."""
    nll_ref = nll_q = kl = 0.0
    agree = positions = predicted = 0
    diffs: list[float] = []  # per window: the quantized engine's total NLL minus the reference's
    counts: list[int] = []
    stopped = "text"
    total = sum(len(w) for w in windows)
    if precision is not None:
        total = min(total, precision.max_tokens)
    start = time.perf_counter()
    step = max(1, len(windows) // 10)
    for i, ids in enumerate(windows):
        if precision is not None and positions >= precision.max_tokens:
            stopped = "limit"
            break
        if precision is not None and positions >= precision.min_tokens and predicted:
            d = (nll_q - nll_ref) / predicted
            if 100 * np.exp(d) * _ci95(diffs, counts, d) <= precision.ppl_ci95:
                stopped = "precision"
                break
        if progress is not None and i and i % step == 0:
            elapsed = time.perf_counter() - start
            left = elapsed * max(0, total - positions) / positions
            progress(f"      scored {positions}/{total} tokens, {elapsed:.0f}s elapsed, ETA at most {left:.0f}s")
        lr = reference(i, ids).astype(np.float64)
        lq = log_softmax(quantized(i, ids)).astype(np.float64)
        targets = np.asarray(ids[1:])
        rows = np.arange(len(targets))
        r, q = -float(lr[rows, targets].sum()), -float(lq[rows, targets].sum())
        nll_ref += r
        nll_q += q
        diffs.append(q - r)
        counts.append(len(targets))
        predicted += len(targets)
        kl += float((np.exp(lr) * (lr - lq)).sum())
        agree += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        positions += len(ids)
    if not predicted:
        raise LlmcError("accuracy evaluation: no held-out text to score (the tokenizer produced no windows)")
    ppl_ref = float(np.exp(nll_ref / predicted))
    ppl = float(np.exp(nll_q / predicted))
    d = (nll_q - nll_ref) / predicted
    ci = _ci95(diffs, counts, d)
    return Accuracy(ppl_reference=ppl_ref, ppl=ppl, ppl_increase_pct=100.0 * (ppl / ppl_ref - 1.0),
                    kl_mean=kl / positions, top1_agreement=agree / positions, tokens=positions,
                    windows=len(counts), window=max(len(w) for w in windows[: len(counts)]),
                    ppl_increase_ci95=100.0 * float(np.exp(d)) * ci if np.isfinite(ci) else None, stopped=stopped)


def rounds(windows: list[list[int]], precision: Precision | None, round_tokens: int | None = None) -> list[int]:
    """Where each round of layer-by-layer scoring ends (window indices, increasing): the first round reaches the
    stopping rule's first check (``min_tokens``) and the window after it, the next the token limit, so a model
    that is precise early pays for no more than one extra window, and the same windows are scored as one by one.
    ``round_tokens`` caps a round's tokens (the memory of the activations kept between layers)."""
    n = len(windows)
    cum = [0]  # cum[i]: tokens of windows[:i], what compare() has scored when it reaches window i
    for w in windows:
        cum.append(cum[-1] + len(w))
    if precision is None:
        ends = [n]
    else:  # compare() stops before window i once cum[i] reaches max_tokens; checks precision from min_tokens
        stop = next((i for i in range(n + 1) if cum[i] >= precision.max_tokens), n)
        first = next((i for i in range(n + 1) if cum[i] >= precision.min_tokens), n)
        ends = sorted({min(first + 1, stop), stop})
    if round_tokens is not None:
        capped, start = [], 0
        for end in ends:
            for j in range(start + 1, end):
                if cum[j + 1] - cum[start] > round_tokens:
                    capped.append(j)
                    start = j
            capped.append(end)
            start = end
        ends = capped
    return [e for e in ends if e > 0]


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
