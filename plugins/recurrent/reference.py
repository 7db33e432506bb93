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


def _l2norm(x: np.ndarray) -> np.ndarray:
    """transformers' (and FLA's) l2norm: ``x * rsqrt(sum(x^2) + 1e-6)`` over the last axis."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def gated_delta_rule(query: np.ndarray, key: np.ndarray, value: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state_slots: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray,
                     state: np.ndarray, num_k_heads: int, num_v_heads: int, use_qk_l2norm: bool = True) -> np.ndarray:
    """The gated delta rule (Gated DeltaNet) token by token on packed rows: transformers' recurrent form.

    ``query``, ``key`` ``[T, Hk*Dk]``, ``value`` ``[T, Hv*Dv]``, ``g`` (log decay, <= 0) and ``beta`` ``[T, Hv]``;
    value head ``h`` reads query/key head ``h // (Hv // Hk)``. Per sequence, from its slot's state ``[Hv, Dk, Dv]``
    (zeros when fresh), for each token: ``S *= exp(g)``; ``S += k (beta (v - S^T k))^T``; ``out = S^T q``, with q
    and k L2-normalised (``use_qk_l2norm``) and q scaled by ``Dk^-0.5``. The slot then holds the last state.
    """
    t_all = query.shape[0]
    dk = query.shape[1] // num_k_heads
    dv = value.shape[1] // num_v_heads
    rep = num_v_heads // num_k_heads
    q = np.repeat(query.reshape(t_all, num_k_heads, dk).astype(np.float32), rep, axis=1)
    k = np.repeat(key.reshape(t_all, num_k_heads, dk).astype(np.float32), rep, axis=1)
    v = value.reshape(t_all, num_v_heads, dv).astype(np.float32)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * np.float32(dk ** -0.5)
    out = np.zeros((t_all, num_v_heads, dv), np.float32)
    for slot, b, e, fresh in sequences(state_slots, context_lens, query_start_loc):
        s = np.zeros((num_v_heads, dk, dv), np.float32) if fresh else state[slot].astype(np.float32)
        for t in range(b, e):
            s = s * np.exp(g[t].astype(np.float32))[:, None, None]
            kv_mem = (s * k[t][:, :, None]).sum(1)  # [Hv, Dv]
            delta = (v[t] - kv_mem) * beta[t].astype(np.float32)[:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(1)
        state[slot] = s
    return out.reshape(t_all, num_v_heads * dv)


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (threshold 20: above it, x itself)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def ssd_scan(x: np.ndarray, b: np.ndarray, c: np.ndarray, dt: np.ndarray, a_log: np.ndarray, d: np.ndarray,
             dt_bias: np.ndarray, state_slots: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray,
             state: np.ndarray, num_heads: int, n_groups: int, dt_min: float = 0.0,
             dt_max: float = float("inf")) -> np.ndarray:
    """Mamba2's selective scan (state space duality) token by token on packed rows: transformers' recurrent form.

    ``x`` ``[T, H*P]``, ``b``/``c`` ``[T, G*N]`` (head ``h`` reads group ``h // (H // G)``), ``dt`` ``[T, H]`` before
    its bias. Per head: ``dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max)``, ``A = -exp(a_log)``; for each token
    ``S = exp(dt' A) S + dt' x B^T`` (``S`` ``[P, N]``, zeros when fresh), ``y = S C + D x``. The slot ``[H, P, N]``
    then holds the last state.
    """
    t_all = x.shape[0]
    p = x.shape[1] // num_heads
    n = b.shape[1] // n_groups
    rep = num_heads // n_groups
    xs = x.reshape(t_all, num_heads, p).astype(np.float32)
    bs = np.repeat(b.reshape(t_all, n_groups, n).astype(np.float32), rep, axis=1)  # [T, H, N]
    cs = np.repeat(c.reshape(t_all, n_groups, n).astype(np.float32), rep, axis=1)
    step = np.clip(_softplus(dt.astype(np.float32) + dt_bias.astype(np.float32)), dt_min, dt_max)  # [T, H]
    a = -np.exp(a_log.astype(np.float32))
    out = np.zeros((t_all, num_heads, p), np.float32)
    for slot, lo, hi, fresh in sequences(state_slots, context_lens, query_start_loc):
        s = np.zeros((num_heads, p, n), np.float32) if fresh else state[slot].astype(np.float32)
        for t in range(lo, hi):
            s = s * np.exp(step[t] * a)[:, None, None] + (step[t][:, None] * xs[t])[:, :, None] * bs[t][:, None, :]
            out[t] = (s * cs[t][:, None, :]).sum(-1) + d.astype(np.float32)[:, None] * xs[t]
        state[slot] = s
    return out.reshape(t_all, num_heads * p)
