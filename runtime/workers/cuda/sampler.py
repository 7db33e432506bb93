"""Sampling where the logits are: the CUDA engine's sampler, in torch, with :mod:`.sampler`'s semantics.

Why: without it a GPU step copies ``[rows, vocab]`` float32 logits to the host and samples each row
in numpy (batch 64 x vocab 32000 is 8 MB over PCIe per step and, with ``top_p``, a 32k-element
argsort per row on one core). Here the rows are processed together on the device and only token ids,
and the logprobs a request asked for, come back.

Same tokens as :func:`llmc.runtime.sampling.sampler.sample`:

- greedy: the argmax of the same float32 penalised logits (ties: the lowest id, as numpy's);
- sampled: the request's uniform is drawn on the host from its own ``numpy.random.Generator``, one
  ``random()`` per token, exactly what ``Generator.choice(p=...)`` draws, and the CDF is inverted on
  the device with ``choice``'s arithmetic (float64 cumulative sum, normalised by its last entry,
  right-side search). A seed gives the CPU sampler's tokens wherever the two float64 distributions
  agree to within the uniform's distance from a CDF boundary (parts in 1e16), and the tokens of one
  request do not depend on what it is batched with.

Penalties are applied with the CPU sampler's float32 arithmetic (the per-token deltas are computed
on the host with numpy, from the request's history, and added on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmc.runtime.sampling.sampler import SampleRow, presence_frequency_deltas


def _penalise(x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Apply each row's penalties to ``x`` ``[len(rows), vocab]`` float32 in place (numpy's float32 rounding)."""
    for i, r in enumerate(rows):
        p = r.params
        if not p.uses_history:
            continue
        if p.repetition_penalty != 1.0 and len(r.context):
            ids = torch.from_numpy(np.unique(np.asarray(r.context, np.int64))).to(x.device)
            seen = x[i, ids]
            pen = torch.tensor(p.repetition_penalty, dtype=torch.float32, device=x.device)
            x[i, ids] = torch.where(seen > 0, seen / pen, seen * pen)
        output = r.context[r.prompt_len:]
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and len(output):
            ids, delta = presence_frequency_deltas(output, p.presence_penalty, p.frequency_penalty)
            x[i, torch.from_numpy(ids).to(x.device)] -= torch.from_numpy(delta).to(x.device)


def _renormalise(probs: torch.Tensor, new: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """``new / new.sum()`` in the rows where ``on``, ``probs`` elsewhere (rows without the step stay as they were)."""
    return torch.where(on[:, None], new / new.sum(-1, keepdim=True), probs)


def probabilities(scaled_rows: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """The float64 distributions ``[n, vocab]`` :func:`llmc.runtime.sampling.sampler.probabilities` gives, for
    penalised float32 logits ``scaled_rows`` ``[n, vocab]``: temperature, top_k, top_p, min_p, in that order."""
    dev, vocab = scaled_rows.device, scaled_rows.shape[-1]
    f64 = dict(dtype=torch.float64, device=dev)
    temps = torch.tensor([r.params.temperature for r in rows], **f64)
    s = scaled_rows.double() / temps[:, None]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    if any(ks):
        top = torch.topk(s, max(ks), dim=-1).values  # descending: column k-1 is the k-th largest
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, torch.tensor(-torch.inf, **f64))
        s = torch.where(s < kth, torch.tensor(-torch.inf, **f64), s)
    probs = torch.exp(s - s.max(-1, keepdim=True).values)
    probs = probs / probs.sum(-1, keepdim=True)
    top_p = torch.tensor([r.params.top_p for r in rows], **f64)
    if bool((top_p < 1.0).any()):
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        cumulative = torch.cumsum(ordered, dim=-1)
        # The smallest prefix whose mass reaches top_p (numpy's searchsorted, side "left", plus one).
        count = torch.searchsorted(cumulative, top_p[:, None].contiguous()) + 1
        keep_sorted = torch.arange(vocab, device=dev)[None, :] < count
        keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        probs = _renormalise(probs, torch.where(keep, probs, 0.0), top_p < 1.0)
    min_p = torch.tensor([r.params.min_p for r in rows], **f64)
    if bool((min_p > 0.0).any()):
        floor = min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = _renormalise(probs, torch.where(probs < floor, 0.0, probs), min_p > 0.0)
    return probs


def invert_cdf(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """Token ids ``[n]`` as ``numpy.random.Generator.choice(vocab, p=probs[i])`` picks them for ``uniforms[i]``."""
    cdf = torch.cumsum(probs, dim=-1)
    cdf = cdf / cdf[:, -1:]
    u = torch.tensor(list(uniforms), dtype=torch.float64, device=probs.device)[:, None]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def logprobs(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]) -> list[dict[int, float]]:
    """:func:`llmc.runtime.sampling.sampler.token_logprobs` for every row of ``logits`` ``[n, vocab]`` (the model's own
    distribution): the chosen token's log-probability and the ``tops[i]`` most likely ids' (ties: lower id first)."""
    x = logits.double()
    m = x.max(-1, keepdim=True).values
    logz = m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))
    lp = x - logz
    chosen = lp.gather(1, torch.tensor(list(tokens), device=x.device)[:, None])[:, 0].tolist()
    k = min(max(tops, default=0), x.shape[-1])
    vals, ids = (torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    vals, ids = vals.tolist(), ids.tolist()
    out = []
    for i, (token, top) in enumerate(zip(tokens, tops, strict=True)):
        row = sorted(zip(vals[i][:top], ids[i][:top], strict=True), key=lambda vi: (-vi[0], vi[1]))
        d = {int(t): float(v) for v, t in row}
        d[int(token)] = float(chosen[i])
        out.append(d)
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[dict[int, float] | None]]:
    """Pick one token for each of ``rows`` from ``logits`` ``[N, vocab]`` (any float dtype, on any device).

    Returns the token ids and, per row, its logprobs (``params.logprobs`` set) or None.
    """
    if not rows:
        return [], []
    with torch.inference_mode():
        x = logits[torch.tensor([r.index for r in rows], device=logits.device)].float()
        raw = x  # logprobs read the model's own logits
        if any(r.params.uses_history for r in rows):
            x = x.clone()
            _penalise(x, rows)
        tokens = torch.argmax(x, dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            missing = [rows[i].index for i in sampled if rows[i].uniform is None]
            if missing:
                raise ValueError(f"sample_rows: sampled rows {missing} need a uniform")
            at = torch.tensor(sampled, device=x.device)
            probs = probabilities(x[at], [rows[i] for i in sampled])
            tokens[at] = invert_cdf(probs, [rows[i].uniform for i in sampled])
        ids = tokens.tolist()
        wants = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        lps: list[dict[int, float] | None] = [None] * len(rows)
        if wants:
            got = logprobs(raw[torch.tensor(wants, device=x.device)], [ids[i] for i in wants],
                           [rows[i].params.logprobs for i in wants])
            for i, d in zip(wants, got, strict=True):
                lps[i] = d
        return ids, lps
