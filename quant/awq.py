"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling before INT4 rounding.

Channels that carry large activations matter more, so their weights are scaled up by ``s`` before
rounding (finer relative steps) and the input is scaled down by ``s``, which the preceding op
absorbs (an RMSNorm weight, or the previous linear layer's output rows). ``s = mean|x|^α``
(normalised), with ``α`` searched on a grid. The search objective is the layer's output error on
the calibration set, ``Σ_rows e H eᵀ`` with ``e`` the weight error and ``H = XᵀX / n``: exact, and it
needs only the Gram matrix, never the activations themselves. A second search then picks, per
output row and group, how much to clip the weight range (AutoAWQ's ``auto_clip``), scoring each
choice by the same objective restricted to the group's block of ``H``.

Cost: the scale search would be ``ALPHA_GRID`` products ``e H`` of ``[N, K] x [K, K]`` (a 1B model's down
projection: 275 GFLOP each). The objective is a sum over rows, so a screen scores every candidate on at most
:data:`SCREEN_ROWS` rows, and only the candidates the screen cannot tell from the best (by the sampling
error of their gap) are scored on every row; all as bfloat16 GEMMs in torch (4x float32's rate with AVX-512
BF16), summed over rows in float64. The clip search's per-group ``e_g H_g e_gᵀ`` runs as float32 batched
matmuls over groups, its rounding in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.quant import int4

ALPHA_GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 … 0.5
# The scale search's screen: at most this many output rows score every candidate.
SCREEN_ROWS = 512
# Candidates whose screened gap to the best is within this many standard errors of the row sampling are scored
# on every row. (bfloat16's rounding, ~3e-4 of the objective, is no reason to re-score: the full-row score rounds
# alike, and it is mostly common to all candidates, since they share the rounded H.)
SCREEN_SIGMAS = 3.0
# ... and only if it might beat the screen's best by more than this fraction of the objective: a smaller gain in
# the layer's output error is below what the calibration sample itself can resolve.
SCREEN_MATTERS = 1e-3
SCREEN_FINALISTS = 3
# Elementwise work on weights runs this many elements at a time (16 MB of float64).
ROW_CHUNK_ELEMENTS = 1 << 21


@dataclass
class ScaleSearch:
    """Outcome of the scale search for one group of linears sharing an input: ``scales`` ``[K]``
    (the input is divided by them, the weights' columns multiplied), the chosen ``alpha`` and the
    objective at ``alpha = 0`` (plain RTN; estimated from the screen's rows unless RTN won) and at the
    optimum."""

    scales: np.ndarray
    alpha: float
    loss_rtn: float
    loss: float


def torch_hessian(hessian):
    import torch

    if isinstance(hessian, torch.Tensor):
        return hessian
    return torch.from_numpy(np.ascontiguousarray(hessian, np.float32))


def output_error(w: np.ndarray, w_hat: np.ndarray, hessian) -> float:
    """``Σ_rows (w - w_hat) H (w - w_hat)ᵀ``: the mean squared output error over the calibration rows, summed.

    ``hessian`` is ``[K, K]`` (numpy, or a float32 torch tensor to reuse across calls)."""
    import torch

    e = torch.from_numpy((np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)).astype(np.float32))
    return float(((e @ torch_hessian(hessian)) * e).sum(dtype=torch.float64))


def bf16_upper(hessian):
    """bfloat16 ``2·triu(H, 1) + diag(H)`` ``[K, K]`` of a numpy or float32 torch ``H``: the form of ``H`` the
    bfloat16 output errors read (``e H eᵀ = Σ_i≤j e_i M_ij e_j`` for a symmetric ``H``). Doubling is exact, so
    its entries are those of the bfloat16 ``H``."""
    import torch

    h = torch_hessian(hessian)
    m = torch.triu(h, 1).mul_(2.0)
    m.diagonal().copy_(h.diagonal())
    return m.bfloat16()


def bf16_upper_from_gram(gram: np.ndarray, rows: int, panel: int = 1024):
    """:func:`bf16_upper` of ``H = gram / rows`` (``gram`` float32 ``[K, K]``), made a panel of rows at a time: the
    same bits (every step is elementwise: the float32 quotient, the doubling, the rounding to bfloat16) without
    the whole float32 ``H`` and its doubled triangle beside the Gram (at K = 8192, 536 MB of a 1B model's
    calibration peak)."""
    import torch

    g = torch.from_numpy(gram)
    k = g.shape[0]
    out = torch.empty((k, k), dtype=torch.bfloat16)
    for i0 in range(0, k, panel):
        h = g[i0 : i0 + panel].to(torch.float32) / max(rows, 1)
        m = torch.triu(h, i0 + 1).mul_(2.0)
        r = torch.arange(h.shape[0])
        m[r, r + i0] = h[r, r + i0]
        out[i0 : i0 + panel] = m.bfloat16()
    return out


def bf16_output_error(e, upper) -> float:
    """:func:`output_error` from bfloat16 GEMMs (~3e-4 relative, tested): ``e`` the float32 torch weight error
    ``[N, K]``, ``upper`` the :func:`bf16_upper` form of ``H``."""
    return float(_bf16_row_errors(e, upper).sum())


# Columns of the upper form per GEMM: e H eᵀ reads only M's upper triangle, a panel of rows of M at a time
# (from its diagonal rightwards): 56 % of the full GEMM's flops at K = 8192, 75 % at 2048, with fewer, wider
# panels faster than more, narrower ones here (1024: 27 % off the full-H form's time at K = 8192, 512: 18 %).
UPPER_PANEL = 1024


def _bf16_row_errors(e, upper, chunk: int = 256):
    """float64 ``[N]``: each row's ``e_r H e_rᵀ`` from bfloat16 GEMMs against the :func:`bf16_upper` form of ``H``,
    ``chunk`` rows at a time (bounded scratch, in cache: 256 rows ran 15-40 % faster than 2048 on a 1B model's
    shapes, with the same figures)."""
    import torch

    k = e.shape[1]
    out = torch.zeros(e.shape[0], dtype=torch.float64)
    for r0 in range(0, e.shape[0], chunk):
        part = e[r0 : r0 + chunk]
        part_bf16 = part.bfloat16()
        acc = out[r0 : r0 + chunk]
        for i in range(0, k, UPPER_PANEL):
            y = part_bf16[:, i : i + UPPER_PANEL] @ upper[i : i + UPPER_PANEL, i:]
            acc += (y.float() * part[:, i:]).sum(1, dtype=torch.float64)
    return out


def screen_rows(n: int, k: int = 2048) -> np.ndarray:
    """The rows the screen scores: all of them up to :data:`SCREEN_ROWS` (fewer for ``k`` above 2048, so that a
    screen costs at most that of 512 rows at K = 2048, down to 128 rows), else evenly spaced ones (fixed, so a
    build is reproducible; output channels carry no order the spacing could alias with)."""
    budget = max(128, min(SCREEN_ROWS, SCREEN_ROWS * 2048 * 2048 // (k * k)))
    if n <= budget:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, budget).round().astype(np.int64))


def search_scales(w: np.ndarray, abs_mean: np.ndarray, hessian: np.ndarray | None, group_size: int,
                  symmetric: bool, upper=None) -> ScaleSearch:
    """Grid-search ``α`` for ``w [N, K]`` (the group's linears stacked) given its input statistics.

    The objective is a sum over output rows, each row quantized on its own. A screen scores every candidate on
    :func:`screen_rows` (at most :data:`SCREEN_ROWS` of them) with bfloat16 GEMMs: its estimate of the full sum
    is exact in expectation, and each candidate's gap to the screen's best has a sampling error estimated from
    the per-row paired differences. Candidates that might still beat the screen's best by more than
    :data:`SCREEN_MATTERS` of the objective (within :data:`SCREEN_SIGMAS` standard errors) are scored on every
    row (at most :data:`SCREEN_FINALISTS`, in the screen's order), again with bfloat16 GEMMs (~3e-4 relative,
    tested), and the lowest wins. A 1B model's down projection (2048 x 8192): a screen candidate costs 17 GFLOP
    instead of 275, and a bfloat16 GFLOP a quarter of a float32 one here. ``upper``: :func:`bf16_upper` of
    ``hessian`` already made (e.g. :func:`bf16_upper_from_gram`); ``hessian`` is then not read.
    """
    import torch

    w = np.ascontiguousarray(w, np.float32)  # candidates are scaled and fake-quantized in float32 (row_losses)
    x_mean = np.maximum(np.asarray(abs_mean, np.float64), 1e-4)
    upper = bf16_upper(hessian) if upper is None else upper
    n = w.shape[0]
    rows = screen_rows(n, w.shape[1])

    def scales(alpha: float) -> np.ndarray:
        s = x_mean**alpha
        return s / np.sqrt(s.max() * s.min())

    w_t = torch.from_numpy(w)
    screen_w = w_t[torch.from_numpy(rows)]

    def row_losses(alpha: float, part=w_t):
        """Each row's ``e_r H e_rᵀ`` for this ``alpha``: float32 scaling and fake quantization, a bfloat16 GEMM,
        in torch, a few MB of rows at a time (2-3x faster than whole tensors here: the temporaries stay in cache
        and in the heap, where a 200 MB one faults in fresh pages); a row's figure does not depend on the chunking.
        The stored weights scale in float64 (:func:`quantize`); scaling candidates in float32 moves their errors
        by float32 rounding (a code where a value sits on a rounding boundary), far below the GEMM's bfloat16
        rounding, at a sixth of float64's cost."""
        s_t = torch.from_numpy(scales(alpha).astype(np.float32))
        out = torch.empty(part.shape[0], dtype=torch.float64)
        step = max(1, ROW_CHUNK_ELEMENTS // part.shape[1])
        for r0 in range(0, part.shape[0], step):
            p = part[r0 : r0 + step]
            w_hat = int4.torch_rtn_dequantized(p * s_t, group_size, symmetric) / s_t
            out[r0 : r0 + step] = _bf16_row_errors(p - w_hat, upper)
        return out

    alphas = [float(a) for a in np.arange(ALPHA_GRID) / ALPHA_GRID]
    per_row = torch.stack([row_losses(a, screen_w) for a in alphas]).numpy()
    screened = per_row.mean(1) * n
    best_i = int(np.argmin(screened))
    gaps = per_row - per_row[best_i]
    m = len(rows)
    # Standard error of each candidate's estimated gap to the best (a sample without replacement of m of n rows).
    se = n * gaps.std(1, ddof=1) / np.sqrt(m) * np.sqrt(max(0.0, 1 - m / n)) if m > 1 else np.zeros(len(alphas))
    # A candidate is scored on every row only if it might beat the screen's best by more than SCREEN_MATTERS of
    # the objective: an upper bound of its true advantage (SCREEN_SIGMAS standard errors less its screened gap).
    keep = SCREEN_SIGMAS * se - gaps.mean(1) * n > SCREEN_MATTERS * screened[best_i]
    # At most SCREEN_FINALISTS of them, the screen's best first: a layer whose candidates the screen cannot tell
    # apart has a flat objective, where the choice among them moves the output error by little.
    keep[np.argsort(screened, kind="stable")[SCREEN_FINALISTS:]] = False
    keep[best_i] = True
    if m == n:  # the screen saw every row: its figures are the full objective's
        i = best_i
        return ScaleSearch(scales(alphas[i]).astype(np.float32), alphas[i], float(screened[0]), float(screened[i]))
    best = None
    for alpha, kept in zip(alphas, keep, strict=True):
        if not kept:
            continue
        loss = float(row_losses(alpha).sum())
        if best is None or loss < best[2]:
            best = (scales(alpha), alpha, loss)
    # Plain RTN's figure is only reported: the screen's estimate, unless RTN itself won.
    loss_rtn = best[2] if best[1] == 0.0 else float(screened[0])
    return ScaleSearch(best[0].astype(np.float32), best[1], loss_rtn, best[2])


def search_clip(w: np.ndarray, hessian: np.ndarray, group_size: int, symmetric: bool) -> np.ndarray:
    """Per (row, group) clip ratio from :data:`CLIP_RATIOS` minimising that group's output error.

    ``w [N, K]`` is the (already scaled) weight and ``hessian`` its input's (scaled) ``XᵀX / n``.
    Returns float32 ``[N, n_groups]``. The codes, scales and zero points of each ratio are computed in torch
    with the arithmetic of :func:`int4.group_params` / :func:`int4.quantize_groups` (float32, round half to
    even), and each group's ``e_g H_g e_gᵀ`` as one float32 batched matmul over groups, in row chunks.
    """
    return _search_clip_blocks(w, diagonal_blocks(hessian, group_size), group_size, symmetric)


def diagonal_blocks(hessian: np.ndarray, group_size: int) -> np.ndarray:
    """``[G, group_size, group_size]``: the blocks of ``hessian [K, K]`` on its diagonal, one per group of inputs
    (zero-padded past K): all that the clip search reads of ``H``."""
    k = hessian.shape[0]
    n_groups = -(-k // group_size)
    out = np.zeros((n_groups, group_size, group_size), hessian.dtype)
    for g in range(n_groups):
        block = hessian[g * group_size : (g + 1) * group_size, g * group_size : (g + 1) * group_size]
        out[g, : block.shape[0], : block.shape[1]] = block
    return out


def _search_clip_blocks(w: np.ndarray, blocks: np.ndarray, group_size: int, symmetric: bool) -> np.ndarray:
    """:func:`search_clip` given :func:`diagonal_blocks` of the Hessian."""
    import torch

    groups = torch.from_numpy(int4.padded_groups(np.asarray(w, np.float32), group_size))  # [N, G, gs]
    n, n_groups, _ = groups.shape
    blocks = torch.from_numpy(np.asarray(blocks, np.float32))
    best = torch.ones(n, n_groups)
    # Rows per chunk: 2 MB of float32 per tensor, which stays in cache (twice the speed of 16 MB chunks here).
    chunk = max(1, (1 << 19) // (n_groups * group_size))
    for r0 in range(0, n, chunk):
        g = groups[r0 : r0 + chunk]
        extremes = int4.torch_extremes(g, symmetric)  # once per chunk; each ratio scales them
        best_loss = torch.full(g.shape[:2], float("inf"), dtype=torch.float32)
        pick = torch.ones(g.shape[:2])
        for ratio in CLIP_RATIOS:
            r = torch.tensor(ratio, dtype=torch.float32)
            scale, zero = int4.torch_params(extremes, symmetric, r)
            q = int4.torch_codes(g, scale, zero)
            e = ((q - zero[..., None]) * scale[..., None] - g).transpose(0, 1)  # [G, rows, gs]
            loss = (torch.bmm(e, blocks) * e).sum(-1).transpose(0, 1)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            pick = torch.where(better, r, pick)
        best[r0 : r0 + chunk] = pick
    return best.numpy()


def quantize(w: np.ndarray, scales: np.ndarray, hessian: np.ndarray | None, group_size: int, symmetric: bool,
             clip: bool = True, blocks: np.ndarray | None = None) -> int4.Int4Weights:
    """INT4 of ``w * scales`` (columns), with the clipping search unless ``clip`` is False.

    The caller divides the input by ``scales`` (folds ``1 / scales`` into the preceding op). ``blocks``: the
    Hessian's :func:`diagonal_blocks`, when the caller already has them (the clip search reads nothing else).
    """
    import torch

    w_t = torch.from_numpy(np.ascontiguousarray(w, np.float32))
    s_t = torch.from_numpy(np.asarray(scales, np.float64))
    scaled = torch.empty(w_t.shape, dtype=torch.float32)
    step = max(1, ROW_CHUNK_ELEMENTS // max(1, w_t.shape[1]))
    for r0 in range(0, w_t.shape[0], step):  # float64 products, a chunk of rows at a time
        scaled[r0 : r0 + step] = w_t[r0 : r0 + step].double() * s_t
    scaled = scaled.numpy()
    if not clip:
        return int4.quantize_rtn(scaled, group_size, symmetric)
    if blocks is None:
        blocks = diagonal_blocks(hessian, group_size)
    # H / outer(s, s) restricted to the diagonal blocks: the same float64 quotients as on the whole matrix.
    s = np.pad(np.asarray(scales, np.float64), (0, blocks.shape[0] * group_size - len(scales)), constant_values=1.0)
    s = s.reshape(-1, group_size)
    scaled_blocks = blocks / (s[:, :, None] * s[:, None, :])
    ratios = _search_clip_blocks(scaled, scaled_blocks, group_size, symmetric)
    return int4.quantize_rtn(scaled, group_size, symmetric, clip=ratios)
