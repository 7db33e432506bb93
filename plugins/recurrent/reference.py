"""Reference recurrent-state ops in numpy: slow, obviously correct, the definition every kernel is tested against."""

from __future__ import annotations

import numpy as np


def sequences(state_slots: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray):
    """Per sequence of the step: ``(slot, first row, end row, fresh)``; fresh = its whole context is this step's."""
    for s, slot in enumerate(state_slots.tolist()):
        b, e = int(query_start_loc[s]), int(query_start_loc[s + 1])
        yield int(slot), b, e, int(context_lens[s]) == e - b


def causal_conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, state_slots: np.ndarray,
                  context_lens: np.ndarray, query_start_loc: np.ndarray, state: np.ndarray,
                  activation: int = 0) -> np.ndarray:
    """Causal depthwise convolution of packed rows ``x`` ``[T, C]`` with ``weight`` ``[C, K]``.

    Each sequence's inputs are preceded by its slot's last ``K-1`` inputs ``state[slot]`` ``[C, K-1]`` (zeros
    when it starts fresh); ``out[t, c] = bias[c] + sum_j weight[c, j] * xs[c, t + j]`` over that padded
    sequence ``xs``. The slot then holds the last ``K-1`` inputs. ``activation`` 1 applies SiLU. Float32.
    """
    _, k = weight.shape
    out = np.zeros(x.shape, np.float32)
    for slot, b, e, fresh in sequences(state_slots, context_lens, query_start_loc):
        prior = np.zeros((x.shape[1], k - 1), np.float32) if fresh else state[slot].astype(np.float32)
        xs = np.concatenate([prior, x[b:e].T.astype(np.float32)], axis=1)  # [C, K-1+n]
        for t in range(e - b):
            out[b + t] = (weight * xs[:, t:t + k]).sum(axis=1)
        if bias is not None:
            out[b:e] += bias
        state[slot] = xs[:, xs.shape[1] - (k - 1):]
    if activation == 1:
        out = out / (1.0 + np.exp(-out))
    return out
