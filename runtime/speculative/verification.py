"""Verification of a verify chunk's drafts against the target's logits rows.

Greedy verification is exact (drafts are kept while they equal the target's choice); for ``temperature > 0``
rejection sampling (Leviathan et al. 2023, Chen et al. 2023) makes the emitted tokens' distribution exactly the
target's (after penalties, temperature, top-k/p, min-p). The scheduler rewinds the rejected drafts' KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmc.runtime.sampling.sampler import SamplingParams, apply_penalties, probabilities

# The target's distribution is exactly the sampler's (one function, so they cannot drift apart).
target_probs = probabilities


def greedy_token(logits: np.ndarray, params: SamplingParams, context: Sequence[int], prompt_len: int) -> int:
    """The token ``sample`` picks at ``temperature == 0`` (penalties applied)."""
    return int(np.argmax(apply_penalties(logits, params, context, prompt_len)))


def accept_or_resample(p: np.ndarray, q: np.ndarray | None, draft: int, rng: np.random.Generator) -> int | None:
    """One step of speculative sampling: ``None`` keeps ``draft``, else the replacement token.

    ``p`` ``[vocab]`` is the target's distribution, ``q`` the draft's (``None``: a point mass on
    ``draft``, as for prompt lookup). The draft is kept with probability ``min(1, p[d] / q[d])``;
    otherwise a token is drawn from ``norm(max(p - q, 0))``. Whatever ``q`` is, the result is
    distributed exactly as ``p`` (Leviathan et al. 2023, theorem 3.5).
    """
    qd = 1.0 if q is None else float(q[draft])
    pd = float(p[draft])
    if qd > 0.0 and rng.random() * qd < pd:  # u < p/q, without dividing by a tiny q
        return None
    if q is None:
        residual = p.copy()
        residual[draft] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q: rejection had probability 0; numerically, fall back to p
        residual, total = p, p.sum()
    return int(rng.choice(residual.size, p=residual / total))


def verify(logits: np.ndarray, draft: Sequence[int], draft_probs: np.ndarray | None, params: SamplingParams,
           rng: np.random.Generator, context: list[int], prompt_len: int) -> list[int]:
    """The tokens a verify step emits: the kept drafts, then one token from the target.

    ``logits`` ``[k + 1, vocab]`` are the target's rows for the last known token and the ``k`` drafts;
    ``draft_probs`` ``[k, vocab]`` the draft's distributions (``None``: point masses). ``context`` is the
    sequence so far (prompt + output), extended here by the emitted tokens for the penalties. Greedy:
    a draft is kept while it is the target's argmax, so the output is the non-speculative one.
    """
    k = len(draft)
    out: list[int] = []
    ctx = list(context)
    for i in range(k + 1):
        if params.greedy:
            tok = greedy_token(logits[i], params, ctx, prompt_len)
            out.append(tok)
            if i == k or tok != draft[i]:
                return out
        else:
            p = target_probs(logits[i], params, ctx, prompt_len)
            if i == k:  # every draft kept: the bonus token comes straight from the target
                out.append(int(rng.choice(p.size, p=p)))
                return out
            q = draft_probs[i] if draft_probs is not None else None
            tok = accept_or_resample(p, q, int(draft[i]), rng)
            if tok is not None:
                out.append(tok)
                return out
            out.append(int(draft[i]))
        ctx.append(out[-1])
    return out
