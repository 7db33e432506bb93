"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling before INT4 rounding.

Channels that carry large activations matter more, so their weights are scaled up by ``s`` before
rounding (finer relative steps) and the input is scaled down by ``s``, which the preceding op
absorbs (an RMSNorm weight, or the previous linear layer's output rows). ``s = mean|x|^α``
(normalised), with ``α`` searched on a grid. The search objective is the layer's output error on
the calibration set, ``Σ_rows e H eᵀ`` with ``e`` the weight error and ``H = XᵀX / n``: exact, and it
needs only the Gram matrix, never the activations themselves. A second search then picks, per
output row and group, how much to clip the weight range (AutoAWQ's ``auto_clip``), scoring each
choice by the same objective restricted to the group's block of ``H``.

Cost: the scale search is ``ALPHA_GRID`` products ``e H`` of ``[N, K] x [K, K]`` (a 1B model's down
projection: 275 GFLOP each). They run as bfloat16 GEMMs in torch (a screen; the few near-best candidates
are re-scored as float32 GEMMs, twice numpy's float64 rate), with the sum over rows in float64; the clip
search's per-group ``e_g H_g e_gᵀ`` runs as one batched float64 matmul over groups instead of a
three-operand ``einsum``, which numpy evaluates as scalar loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.quant import int4

ALPHA_GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 … 0.5
# Candidates whose bfloat16-screened objective is within this fraction of the best are re-scored in float32.
SCREEN_TOLERANCE = 0.01


@dataclass
class ScaleSearch:
    """Outcome of the scale search for one group of linears sharing an input: ``scales`` ``[K]``
    (the input is divided by them, the weights' columns multiplied), the chosen ``alpha`` and the
    objective at ``alpha = 0`` (plain RTN) and at the optimum."""

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


def _bf16_output_error(e, h_bf16) -> float:
    import torch

    return float(((e.bfloat16() @ h_bf16).float() * e).sum(dtype=torch.float64))


def search_scales(w: np.ndarray, abs_mean: np.ndarray, hessian: np.ndarray, group_size: int,
                  symmetric: bool) -> ScaleSearch:
    """Grid-search ``α`` for ``w [N, K]`` (the group's linears stacked) given its input statistics.

    Every candidate is first scored with a bfloat16 GEMM (AVX-512 BF16: about 4x the float32 rate here);
    those within :data:`SCREEN_TOLERANCE` of the best are scored again in float32, and the float32 figures
    decide. bfloat16's error on this objective is ~3e-4 relative (tests), 30x below the tolerance, so the
    choice is the float32 objective's unless two candidates tie within float rounding.
    """
    import torch

    w = np.asarray(w, np.float64)
    x_mean = np.maximum(np.asarray(abs_mean, np.float64), 1e-4)
    h = torch_hessian(hessian)
    h_bf16 = h.bfloat16()

    def candidate(alpha: float):
        s = x_mean**alpha
        s = s / np.sqrt(s.max() * s.min())
        w_hat = int4.quantize_rtn((w * s).astype(np.float32), group_size, symmetric).dequantize() / s
        return s, w_hat

    alphas = [float(a) for a in np.arange(ALPHA_GRID) / ALPHA_GRID]
    screened = []
    for alpha in alphas:
        _, w_hat = candidate(alpha)
        e = torch.from_numpy((w - w_hat).astype(np.float32))
        screened.append(_bf16_output_error(e, h_bf16))
    floor = min(screened)
    finalists = [a for a, loss in zip(alphas, screened, strict=True) if loss <= floor * (1 + SCREEN_TOLERANCE)]
    best = None
    for alpha in finalists:
        s, w_hat = candidate(alpha)
        loss = output_error(w, w_hat, h)
        if best is None or loss < best[2]:
            best = (s, alpha, loss)
    loss_rtn = best[2] if best[1] == 0.0 else output_error(w, candidate(0.0)[1], h)
    return ScaleSearch(best[0].astype(np.float32), best[1], float(loss_rtn), best[2])


def search_clip(w: np.ndarray, hessian: np.ndarray, group_size: int, symmetric: bool) -> np.ndarray:
    """Per (row, group) clip ratio from :data:`CLIP_RATIOS` minimising that group's output error.

    ``w [N, K]`` is the (already scaled) weight and ``hessian`` its input's (scaled) ``XᵀX / n``.
    Returns float32 ``[N, n_groups]``.
    """
    import torch

    groups = int4.padded_groups(np.asarray(w, np.float32), group_size)
    n_groups = groups.shape[1]
    k = w.shape[1]
    pad = n_groups * group_size - k
    h = np.pad(hessian, ((0, pad), (0, pad))) if pad else hessian
    blocks = torch.from_numpy(np.stack([h[g * group_size : (g + 1) * group_size, g * group_size : (g + 1) * group_size]
                                        for g in range(n_groups)]).astype(np.float64))
    best_loss = np.full(groups.shape[:2], np.inf)
    best = np.ones(groups.shape[:2], np.float32)
    for ratio in CLIP_RATIOS:
        scale, zp = int4.group_params(groups, symmetric, ratio)
        q = int4.quantize_groups(groups, scale, zp).astype(np.float32)
        zero = np.float32(8.0) if zp is None else zp[..., None].astype(np.float32)
        e = torch.from_numpy(((q - zero) * scale[..., None] - groups).astype(np.float64)).transpose(0, 1)  # [G, N, gs]
        loss = (torch.bmm(e, blocks) * e).sum(-1).transpose(0, 1).numpy()
        better = loss < best_loss
        best_loss = np.where(better, loss, best_loss)
        best = np.where(better, np.float32(ratio), best)
    return best


def quantize(w: np.ndarray, scales: np.ndarray, hessian: np.ndarray, group_size: int, symmetric: bool,
             clip: bool = True) -> int4.Int4Weights:
    """INT4 of ``w * scales`` (columns), with the clipping search unless ``clip`` is False.

    The caller divides the input by ``scales`` (folds ``1 / scales`` into the preceding op).
    """
    scaled = (np.asarray(w, np.float64) * scales).astype(np.float32)
    if not clip:
        return int4.quantize_rtn(scaled, group_size, symmetric)
    scaled_h = hessian / np.outer(scales, scales)
    ratios = search_clip(scaled, scaled_h, group_size, symmetric)
    return int4.quantize_rtn(scaled, group_size, symmetric, clip=ratios)
