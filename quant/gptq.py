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


def quantize(w: np.ndarray, hessian: np.ndarray, group_size: int, symmetric: bool,
             damp: float = 0.01) -> int4.Int4Weights:
    """GPTQ of ``w [N, K]`` given ``hessian [K, K]``; returns the INT4 weights (groups along K)."""
    int4.check_group_size(group_size)
    w = np.array(w, np.float64)
    n, k = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    # Upper Cholesky factor of H^-1: row i holds the update coefficients of column i onto later columns.
    h_inv = np.linalg.inv(np.linalg.cholesky(h))
    h_inv = h_inv.T @ h_inv
    u = np.linalg.cholesky(h_inv).T

    n_groups = -(-k // group_size)
    codes = np.zeros((n, n_groups * group_size), np.uint8)
    scales = np.zeros((n, n_groups), np.float32)
    zps = None if symmetric else np.zeros((n, n_groups), np.uint8)
    block = max(BLOCK, group_size)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].copy()
        err = np.zeros_like(wb)
        ub = u[b0:b1, b0:b1]
        scale = zp = None
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                # The group lies inside this block (block is a multiple of the group size): use its current values.
                cols = wb[:, i : i + group_size]
                if cols.shape[1] < group_size:
                    cols = np.concatenate([cols, np.zeros((n, group_size - cols.shape[1]))], axis=1)
                scale, zp = int4.group_params(cols[:, None, :], symmetric)
                scale, zp = scale[:, 0], None if zp is None else zp[:, 0]
                scales[:, g] = scale
                if zps is not None:
                    zps[:, g] = zp
            q = int4.quantize_groups(wb[:, i : i + 1], scale, zp)[:, 0]
            codes[:, col] = q
            zero = np.float32(8.0) if zp is None else zp.astype(np.float32)
            w_hat = (q.astype(np.float32) - zero) * scale
            e = (wb[:, i] - w_hat) / ub[i, i]
            wb[:, i:] -= np.outer(e, ub[i, i:])
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    if zps is not None and k % group_size:  # padding columns: any code decodes them; keep them at the zero point
        codes[:, k:] = np.repeat(zps, group_size, axis=1)[:, k:]
    elif k % group_size:
        codes[:, k:] = 8
    return int4.Int4Weights(codes, scales, zps, group_size, k)
