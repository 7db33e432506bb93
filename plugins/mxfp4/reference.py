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


def mxfp4_moe_matmul(x: np.ndarray, expert_ids: np.ndarray, blocks: np.ndarray, scales: np.ndarray,
                     **epilogue) -> np.ndarray:
    """The op's output ``[..., N]``, float32 (float64 sums rounded once: the kernel's float32 sums differ from it by
    rounding only); ``epilogue``: the op's optional bias, SwiGLU, top-k repeat and sum (:func:`moe_epilogue`)."""
    k = x.shape[-1]
    rows = np.repeat(x.reshape(-1, k).astype(np.float64), epilogue.get("x_share", 1), axis=0)
    ids = np.asarray(expert_ids).reshape(-1)
    w = dequantize(blocks, scales).astype(np.float64)  # [E, N, K]
    out = np.einsum("mk,mnk->mn", rows, w[ids]).astype(np.float32)
    return moe_epilogue(out, ids, x.shape, **epilogue)


def moe_epilogue(out: np.ndarray, ids: np.ndarray, x_shape: tuple[int, ...], bias: np.ndarray | None = None,
                 activation: int = 0, alpha: float = 1.702, limit: float = 7.0, x_share: int = 1, combine: int = 1,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """What both MXFP4 expert ops may apply to their routed rows ``out [M, N]`` (csrc/moe_epilogue.h): ``bias
    [E, N]`` of each row's expert added; with ``activation`` 1 gpt-oss's clamped SwiGLU over interleaved gate/up
    columns (``N / 2`` outputs, :func:`swiglu_oai`); ``combine`` k: ``[M / k, 1, ·]``, each row the
    ``weights``-weighted sum of k consecutive rows. With ``x_share`` or ``combine`` the result is ``[rows, 1, ·]``,
    else X's leading shape ``x_shape[:-1]``."""
    if bias is not None:
        out = out + bias[ids].astype(np.float32)
    if activation:
        out = swiglu_oai(out[:, 0::2], out[:, 1::2], alpha, limit)
    if combine > 1:
        w = np.asarray(weights, dtype=np.float32).reshape(-1, combine, 1)
        out = (out.reshape(-1, combine, out.shape[-1]) * w).sum(axis=1, dtype=np.float32)
    if x_share > 1 or combine > 1:
        return out[:, None, :]
    return out.reshape(*x_shape[:-1], out.shape[-1])


# -- llmc.Mxfp4MoEMatMulQ8: the rows quantized to 8 bits per 32-block (opt-in, not exact) ----------------------

GROUP = 16  # output rows per vector lane group (kGroup in csrc/mxfp4_q8_core.h)


def repack_codes_q8(blocks: np.ndarray) -> np.ndarray:
    """OpenAI's ``blocks [E, N, K/32, 16]`` as the Q8 kernel's codes, uint8 ``[E, T, K/32, 4, 64]`` (T = ceil(N /
    16)): byte ``4 nn + jj`` of pair ``r`` holds the codes of ``n = 16 t + nn`` at ``j = 8 r + jj`` (low nibble) and
    ``8 r + 4 + jj`` (high nibble) of the block. The same codes, moved; rows past N hold code 0. One expert at a time
    (a few hundred MB at gpt-oss's sizes, never the whole tensor unpacked)."""
    e, n, g, _ = blocks.shape
    t = -(-n // GROUP)
    out = np.empty((e, t, g, 4, 64), np.uint8)
    for i in range(e):
        codes = np.zeros((t * GROUP, g, BLOCK), np.uint8)
        codes[:n, :, 0::2] = blocks[i] & 0x0F
        codes[:n, :, 1::2] = blocks[i] >> 4
        c = codes.reshape(t, GROUP, g, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)  # [t, g, r, half, nn, jj]
        out[i] = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(t, g, 4, 64)
    return out


def repack_scales_q8(scales: np.ndarray) -> np.ndarray:
    """``scales [E, N, K/32]`` as the Q8 kernel's, uint8 ``[E, T, K/32, 16]`` (rows past N: exponent 127)."""
    e, n, g = scales.shape
    t = -(-n // GROUP)
    sc = np.full((e, t * GROUP, g), BIAS, np.uint8)
    sc[:, :n] = scales
    return np.ascontiguousarray(sc.reshape(e, t, GROUP, g).transpose(0, 1, 3, 2))


def repack_q8(blocks: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both of the Q8 kernel's weight inputs (:func:`repack_codes_q8`, :func:`repack_scales_q8`)."""
    return repack_codes_q8(blocks), repack_scales_q8(scales)


def quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[M, K]`` as the Q8 kernel quantizes them: int8 ``q [M, K]`` and float32 ``d [M, K/32]`` with
    ``d = max|x| / 127`` per block and ``q = round(x / d)`` (to nearest, ties to even; 0 where d = 0)."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // BLOCK, BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(m, k), d


def mxfp4_moe_matmul_q8(x: np.ndarray, expert_ids: np.ndarray, blocks: np.ndarray, scales: np.ndarray,
                        bias: np.ndarray | None = None, activation: int = 0, alpha: float = 1.702,
                        limit: float = 7.0, x_share: int = 1, combine: int = 1,
                        weights: np.ndarray | None = None) -> np.ndarray:
    """``llmc.Mxfp4MoEMatMulQ8``'s output ``[..., N]``: the rows quantized by :func:`quantize_rows_q8`, times the
    exact MXFP4 weights, in float64 rounded once; then the op's epilogue: ``bias [E, N]`` of each row's expert
    added, and with ``activation`` 1 gpt-oss's clamped SwiGLU over interleaved gate/up columns (``[..., N / 2]``,
    :func:`swiglu_oai`). ``x_share`` k: X ``[R, 1, K]`` holds one row per k routed rows (row m reads X row m // k);
    ``combine`` k: the result is ``[M / k, 1, ·]``, each row the ``weights``-weighted sum of k consecutive rows."""
    k = x.shape[-1]
    q, d = quantize_rows_q8(x.reshape(-1, k))
    rows = (q.astype(np.float64).reshape(len(q), k // BLOCK, BLOCK) * d.astype(np.float64)[..., None]).reshape(-1, k)
    rows = np.repeat(rows, x_share, axis=0)
    ids = np.asarray(expert_ids).reshape(-1)
    w = dequantize(blocks, scales).astype(np.float64)
    out = np.einsum("mk,mnk->mn", rows, w[ids]).astype(np.float32)
    return moe_epilogue(out, ids, x.shape, bias=bias, activation=activation, alpha=alpha, limit=limit,
                        x_share=x_share, combine=combine, weights=weights)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's clamped SwiGLU as transformers writes it (float64, rounded once): ``(clamp(up, -limit, limit) + 1)
    * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""
    g = np.minimum(gate.astype(np.float64), limit)
    u = np.clip(up.astype(np.float64), -limit, limit)
    return ((u + 1) * g / (1 + np.exp(-alpha * g))).astype(np.float32)
