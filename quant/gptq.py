"""GPTQ (Frantar et al., 2022): INT4 rounding column by column with error feedback through the Hessian.

Each column is rounded in turn and its rounding error, weighted by the inverse Hessian of the
layer's squared output error (``H = XᵀX / n`` from calibration), is pushed onto the columns not yet
rounded, so they compensate. Updates are applied lazily in blocks of 128 columns (the paper's
"lazy batch" form). A group's scale and zero point are chosen when the loop reaches the group's
first column, from the weights as updated so far. Dead input channels (never active in
calibration) are zeroed; ``damp`` (a fraction of the mean diagonal) keeps ``H`` invertible.
"""

from __future__ import annotations

import numpy as np

from llmc.quant import int4

BLOCK = 128
SUB = 16  # divides every group size (int4.GROUP_SIZES)


def inverse_factor(hessian: np.ndarray, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """``(u, dead)``: the upper Cholesky factor of the damped ``H^-1`` (row i holds the update coefficients
    of column i onto later columns) and the mask of dead input channels. Linears that share an input
    (Q/K/V, gate/up) share it: compute it once.

    ``H^-1 = uᵀ u`` with ``u = r^-1`` where ``H = r rᵀ``, ``r`` upper triangular: the ordinary Cholesky
    factor of ``H`` with rows and columns reversed, inverted by :func:`_upper_inverse` (K³/3 flops each, as
    GEMMs). float32, as the GPTQ reference code computes it: the 1 % damping keeps the factor far from where
    float32's rounding would matter, and float64 runs at half the rate (8192 x 8192 is a 1B model's down
    projection).
    """
    import torch

    hessian = np.asarray(hessian)
    diag = np.diag(hessian).astype(np.float64)
    dead = diag == 0
    diag[dead] = 1.0
    diag += damp * np.mean(diag)
    flipped = torch.from_numpy(np.ascontiguousarray(hessian[::-1, ::-1], np.float32))  # one float32 copy
    flipped.diagonal().copy_(torch.from_numpy(diag[::-1].astype(np.float32)))
    r = torch.linalg.cholesky(flipped).flip(0, 1)  # upper, H = r rᵀ
    return _upper_inverse(r).numpy(), dead


def _upper_inverse(r, out=None):
    """Inverse of an upper-triangular ``r`` by halves: ``[[A, B], [0, D]]⁻¹ = [[A⁻¹, -A⁻¹ B D⁻¹], [0, D⁻¹]]``,
    K³/3 flops in all (a solve against the identity would spend K³ on known zeros). ``out``: where to write it
    (one zeroed K x K allocation for the whole recursion, not one per level)."""
    import torch

    k = r.shape[0]
    if out is None:
        out = torch.zeros_like(r)
    if k <= 256:
        out.copy_(torch.linalg.solve_triangular(r, torch.eye(k, dtype=r.dtype), upper=True))
        return out
    m = k // 2
    _upper_inverse(r[:m, :m], out[:m, :m])
    _upper_inverse(r[m:, m:], out[m:, m:])
    # -A⁻¹ B D⁻¹ as two triangular solves (m³ flops each; products with the inverses would take 2m³ each)
    x = torch.linalg.solve_triangular(r[:m, :m], r[:m, m:], upper=True)
    out[:m, m:] = -torch.linalg.solve_triangular(r[m:, m:], x, upper=True, left=False)
    return out


def quantize(w: np.ndarray, hessian: np.ndarray | None, group_size: int, symmetric: bool,
             damp: float = 0.01, factor: tuple[np.ndarray, np.ndarray] | None = None) -> int4.Int4Weights:
    """GPTQ of ``w [N, K]`` given ``hessian [K, K]`` (or its :func:`inverse_factor`); returns the INT4
    weights (groups along K). Rows are independent: linears sharing an input can be stacked into one call."""
    int4.check_group_size(group_size)
    w = np.array(w, np.float32)
    n, k = w.shape
    u, dead = factor if factor is not None else inverse_factor(hessian, damp)
    w[:, dead] = 0.0

    n_groups = -(-k // group_size)
    codes = np.zeros((n, n_groups * group_size), np.uint8)
    scales = np.zeros((n, n_groups), np.float32)
    zps = None if symmetric else np.zeros((n, n_groups), np.uint8)
    block = max(BLOCK, group_size)
    # Transposed, so that a column is a contiguous row. Within a block, each column's error feedback goes
    # only to the rest of its sub-block of SUB columns; a sub-block's errors reach the rest of the block in one
    # GEMM, and a block's the rest of the matrix in one GEMM: the same updates, summed in another order,
    # with a fraction of the memory traffic of rank-1 updates over the whole block.
    wt = np.ascontiguousarray(w.T)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = wt[b0:b1]  # a view: updates land in wt
        err = np.zeros_like(wb)
        ub = u[b0:b1, b0:b1]
        scale = zp = zero = None
        for s0 in range(0, b1 - b0, SUB):
            s1 = min(s0 + SUB, b1 - b0)
            for i in range(s0, s1):
                col = b0 + i
                if col % group_size == 0:
                    g = col // group_size
                    # The group lies inside this block (block and sub-block sizes divide the group size) and
                    # every earlier column's feedback has reached it: use its current values.
                    cols = wb[i : i + group_size].T
                    if cols.shape[1] < group_size:
                        cols = np.concatenate([cols, np.zeros((n, group_size - cols.shape[1]), cols.dtype)], axis=1)
                    scale, zp = int4.group_params(cols[:, None, :], symmetric)
                    scale, zp = scale[:, 0], None if zp is None else zp[:, 0]
                    scales[:, g] = scale
                    if zps is not None:
                        zps[:, g] = zp
                    zero = np.float32(8.0) if zp is None else zp.astype(np.float32)
                q = int4.quantize_groups(wb[i][:, None], scale, zp)[:, 0]
                codes[:, col] = q
                w_hat = (q.astype(np.float32) - zero) * scale
                e = (wb[i] - w_hat) / ub[i, i]
                wb[i + 1 : s1] -= np.outer(ub[i, i + 1 : s1], e)
                err[i] = e
            if s1 < b1 - b0:
                wb[s1:] -= ub[s0:s1, s1:].T @ err[s0:s1]
        if b1 < k:
            wt[b1:] -= u[b0:b1, b1:].T @ err
    if zps is not None and k % group_size:  # padding columns: any code decodes them; keep them at the zero point
        codes[:, k:] = np.repeat(zps, group_size, axis=1)[:, k:]
    elif k % group_size:
        codes[:, k:] = 8
    return int4.Int4Weights(codes, scales, zps, group_size, k)
