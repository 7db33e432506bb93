"""The grid-derived inputs of Qwen's vision encoder graph (Qwen3.5, Qwen3-VL), in numpy.

transformers computes them from ``image_grid_thw`` with loops the encoder graph cannot hold
(``transformers.vision_utils``: ``get_vision_interpolation_indices_and_weights`` with bilinear taps and aligned
corners, ``get_vision_position_ids``); the graph takes them as inputs (compiler/qwen_vision.py). Patches are in the
processor's order: merge window by merge window (llmc.runtime.vision.processors.qwen2_vl.patchify). The arithmetic is
transformers' own in float32, so the weights are bit-identical.
"""

from __future__ import annotations

import numpy as np


def patch_rows_cols(grid_t: int, grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Every patch's (row, column) in its frame, int64 ``[grid_t * grid_h * grid_w]`` each, in merge-window order."""
    within = np.arange(grid_t * grid_h * grid_w, dtype=np.int64) % (grid_h * grid_w)
    blocks_w = grid_w // merge
    row = within // (merge * merge * blocks_w) * merge + (within // merge) % merge
    col = (within // (merge * merge)) % blocks_w * merge + within % merge
    return row, col


def _taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One axis's two bilinear taps into a ``side``-long table and their weights (aligned corners)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), np.float32(0))
    return taps, weights.astype(np.float32)


def encoder_inputs(grid: tuple[int, int, int], merge: int, side: int) -> dict[str, np.ndarray]:
    """``interp_indices`` int64 ``[N, 4]`` and ``interp_weights`` float32 ``[N, 4]`` (the learned ``side`` x
    ``side`` position table resampled to the image's grid), ``vision_positions`` int64 ``[N, 2]`` (each patch's row
    and column, the 2-D rotary's positions) of one image of ``grid`` (t, h, w) patches."""
    t, h, w = (int(x) for x in grid)
    row, col = patch_rows_cols(t, h, w, merge)
    h_taps, h_weights = _taps(row, h, side)
    w_taps, w_weights = _taps(col, w, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return {"interp_indices": indices, "interp_weights": weights,
            "vision_positions": np.stack([row, col], axis=-1)}
