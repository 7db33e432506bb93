"""Qwen's 3-D M-RoPE positions of a request (transformers' ``get_rope_index``), in numpy.

Text tokens take one position on all three rows (time, height, width); an image's tokens take ``(start, start + row,
start + column)`` over its merged grid, ``start`` being the position after the text before it; the text after an
image continues from ``start + max(rows, columns)``. A request's prompt gets its table once; every later token (a
decoded one) sits at its index plus the request's ``delta`` (the table's largest position + 1 - prompt length), as
transformers' ``rope_deltas`` place it. The language model of such a build takes the step's rows as
``mrope_positions`` ``[3, T]`` int64 (compiler/vision_encoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prompt_positions(num_tokens: int, images: Sequence[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """``(positions [3, num_tokens] int64, delta)`` of a prompt whose images are ``(first token index, merged grid
    rows, merged grid columns)``, in order."""
    parts, current, prev = [], 0, 0
    for start, rows, cols in images:
        parts.append(np.broadcast_to(np.arange(start - prev, dtype=np.int64) + current, (3, start - prev)))
        current += start - prev
        h, w = np.meshgrid(np.arange(rows, dtype=np.int64), np.arange(cols, dtype=np.int64), indexing="ij")
        parts.append(np.stack([np.zeros(rows * cols, np.int64), h.ravel(), w.ravel()]) + current)
        current += max(rows, cols)
        prev = start + rows * cols
    parts.append(np.broadcast_to(np.arange(num_tokens - prev, dtype=np.int64) + current, (3, num_tokens - prev)))
    table = np.concatenate(parts, axis=1)
    return table, int(table.max(initial=-1)) + 1 - num_tokens


def positions_of(table: np.ndarray | None, delta: int, start: int, count: int) -> np.ndarray:
    """The ``[3, count]`` positions of a request's tokens ``[start, start + count)``: its prompt's table where it
    reaches, its index + ``delta`` after (``table`` None: a request without images, at its indices)."""
    index = np.arange(start, start + count, dtype=np.int64)
    out = np.broadcast_to(index + delta, (3, count)).copy()
    if table is not None:
        inside = index < table.shape[1]
        out[:, inside] = table[:, index[inside]]
    return out
