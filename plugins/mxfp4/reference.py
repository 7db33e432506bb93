"""What ``llmc.Mxfp4MoEMatMul`` computes, in numpy: the tests' reference for the C++ kernel.

``Mxfp4MoEMatMul(X float [..., K], expert_ids int64 (M values, M = the rows of X), blocks uint8 [E, N, K/32, 16],
scales uint8 [E, N, K/32]) -> float [..., N]``: row m of X times the transpose of expert ``expert_ids[m]``'s
weight ``W[e, n, k] = FP4[code(e, n, k)] * 2 ** (scales[e, n, k // 32] - 127)``, where byte ``j`` of block ``g``
holds the codes of ``k = 32 g + 2 j`` (low nibble) and ``32 g + 2 j + 1`` (high nibble), float32 accumulation."""

from __future__ import annotations

import numpy as np

BLOCK = 32
BIAS = 127
# E2M1 by 4-bit code (bit 3 the sign), as transformers' integrations/mxfp4.py FP4_VALUES.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, N, K]`` of MXFP4 ``blocks`` ``[E, N, K/32, 16]`` and ``scales`` ``[E, N, K/32]`` (exact: a
    3-bit significand times a power of two)."""
    e, n, g, _ = blocks.shape
    codes = np.empty((e, n, g, BLOCK), np.uint8)
    codes[..., 0::2] = blocks & 0x0F  # low nibble first
    codes[..., 1::2] = blocks >> 4
    values = FP4_VALUES[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - BIAS).astype(np.float32)[..., None]
    return values.reshape(e, n, g * BLOCK)


def mxfp4_moe_matmul(x: np.ndarray, expert_ids: np.ndarray, blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The op's output ``[..., N]``, float32 (float64 sums rounded once: the kernel's float32 sums differ from it by
    rounding only)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).astype(np.float64)
    ids = np.asarray(expert_ids).reshape(-1)
    w = dequantize(blocks, scales).astype(np.float64)  # [E, N, K]
    out = np.einsum("mk,mnk->mn", rows, w[ids])
    return out.astype(np.float32).reshape(*x.shape[:-1], w.shape[1])
