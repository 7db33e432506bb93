"""What ``llmc.Int4MatMul`` computes, in numpy: the tests' reference for the C++ kernel."""

from __future__ import annotations

import numpy as np


def quantize_activations(x: np.ndarray, group_size: int, k_padded: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes ``[M, Kp]`` and scales ``[M, n_groups]`` of ``x [M, K]``: per row and group,
    ``scale = max|x| / 127`` and ``code = rint(x * (127 / max|x|))`` (0 where the group is all zero)."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xp = np.zeros((m, k_padded), np.float32)
    xp[:, :k] = x
    g = xp.reshape(m, -1, group_size)
    amax = np.abs(g).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    codes = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
    return codes.reshape(m, k_padded), (amax / np.float32(127.0)).astype(np.float32)


def int4_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None,
                group_size: int) -> np.ndarray:
    """``x [M, K] @ W^T`` as the kernel does it, for W given as codes ``[N, Kp]``, scales and zero points
    ``[N, n_groups]`` (None: 8): int8 activations per group, exact integer group dot products, one float
    scale per (row, column, group). float64 sums, float32 result ``[M, N]``."""
    n, kp = codes.shape
    qx, xs = quantize_activations(x, group_size, kp)
    m, ng = xs.shape
    xg = qx.reshape(m, ng, group_size).astype(np.int64)
    wg = codes.reshape(n, ng, group_size).astype(np.int64)
    dots = np.einsum("mgk,ngk->mng", xg, wg).astype(np.float64)  # exact integers
    zp = zero_points if zero_points is not None else np.full(scales.shape, 8, np.uint8)
    xsum = xs.astype(np.float64) * xg.sum(axis=-1)  # [M, ng]
    s = scales.astype(np.float64)
    y = np.einsum("mng,ng,mg->mn", dots, s, xs.astype(np.float64))
    y -= np.einsum("ng,mg->mn", s * zp.astype(np.float64), xsum)
    return y.astype(np.float32)


def swiglu(y: np.ndarray) -> np.ndarray:
    """The SwiGLU epilogue (``activation=1``) on the unfused product ``y = [gate | up]`` ``[M, 2H]``:
    ``silu(gate) * up``, ``[M, H]``, in float64 then float32."""
    h = y.shape[-1] // 2
    g, u = y[:, :h].astype(np.float64), y[:, h:].astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
