"""The recurrent-state ops in torch on a state pool of torch tensors: the CUDA engine's fallback, its kernels' oracle.

Same semantics as :mod:`.reference` (numpy, normative): packed rows, one state slot per sequence, a sequence whose whole
context is this step's rows starts from a zero state, and the slot keeps the state after the sequence's last row.
``state`` is the layer's float32 array ``[num_slots, ...]``, updated in place. One addition for the CUDA engine's
padded decode graphs: a sequence with slot ``-1`` computes from a zero state and stores nothing.

They loop over sequences (and, for the recurrences, tokens) on the host: correct everywhere, fast nowhere; the Triton
kernels of :mod:`.triton_kernels` are what a GPU runs.
"""

from __future__ import annotations

import torch


def _sequences(state_slots: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor):
    qsl = query_start_loc.tolist()
    for s, (slot, ctx) in enumerate(zip(state_slots.tolist(), context_lens.tolist(), strict=True)):
        b, e = int(qsl[s]), int(qsl[s + 1])
        yield int(slot), b, e, int(ctx) == e - b or int(slot) < 0


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state_slots: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, state: torch.Tensor,
                  activation: int = 0) -> torch.Tensor:
    """``x`` ``[T, C]``, ``weight`` ``[C, K]``, ``state`` ``[slots, C, K-1]`` -> ``[T, C]`` in ``x``'s dtype."""
    c, k = weight.shape
    w = weight.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot, b, e, fresh in _sequences(state_slots, context_lens, query_start_loc):
        if e == b:
            continue
        prior = x.new_zeros((c, k - 1), dtype=torch.float32) if fresh else state[slot].float()
        xs = torch.cat([prior, x[b:e].float().T], dim=1)  # [C, K-1+n]
        out[b:e] = (xs.unfold(1, k, 1) * w[:, None, :]).sum(-1).T
        if slot >= 0:
            state[slot] = xs[:, xs.shape[1] - (k - 1):]
    if bias is not None:
        out += bias.float()
    if activation == 1:
        out = torch.nn.functional.silu(out)
    return out.to(x.dtype)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_slots: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     state: torch.Tensor, num_k_heads: int, num_v_heads: int,
                     use_qk_l2norm: bool = True) -> torch.Tensor:
    """The gated delta rule token by token; ``state`` ``[slots, Hv, Dk, Dv]`` -> ``[T, Hv*Dv]``."""
    t_all = query.shape[0]
    dk = query.shape[1] // num_k_heads
    dv = value.shape[1] // num_v_heads
    rep = num_v_heads // num_k_heads
    q = query.float().reshape(t_all, num_k_heads, dk).repeat_interleave(rep, 1)
    k = key.float().reshape(t_all, num_k_heads, dk).repeat_interleave(rep, 1)
    v = value.float().reshape(t_all, num_v_heads, dv)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk ** -0.5
    decay, beta = torch.exp(g.float()), beta.float()
    out = torch.zeros((t_all, num_v_heads, dv), dtype=torch.float32, device=query.device)
    for slot, b, e, fresh in _sequences(state_slots, context_lens, query_start_loc):
        s = q.new_zeros((num_v_heads, dk, dv)) if fresh else state[slot].float().clone()
        for t in range(b, e):
            s = s * decay[t][:, None, None]
            delta = (v[t] - (s * k[t][:, :, None]).sum(1)) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(1)
        if slot >= 0 and e > b:
            state[slot] = s
    return out.reshape(t_all, num_v_heads * dv).to(value.dtype)


def ssd_scan(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor,
             dt_bias: torch.Tensor, state_slots: torch.Tensor, context_lens: torch.Tensor,
             query_start_loc: torch.Tensor, state: torch.Tensor, num_heads: int, n_groups: int, dt_min: float = 0.0,
             dt_max: float = float("inf")) -> torch.Tensor:
    """Mamba2's selective scan token by token; ``state`` ``[slots, H, P, N]`` -> ``[T, H*P]``."""
    t_all = x.shape[0]
    p = x.shape[1] // num_heads
    n = b.shape[1] // n_groups
    rep = num_heads // n_groups
    xs = x.float().reshape(t_all, num_heads, p)
    bs = b.float().reshape(t_all, n_groups, n).repeat_interleave(rep, 1)
    cs = c.float().reshape(t_all, n_groups, n).repeat_interleave(rep, 1)
    step = torch.nn.functional.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)  # [T, H]
    decay = torch.exp(step * -torch.exp(a_log.float()))
    dd = d.float()[:, None]
    out = torch.zeros((t_all, num_heads, p), dtype=torch.float32, device=x.device)
    for slot, lo, hi, fresh in _sequences(state_slots, context_lens, query_start_loc):
        s = xs.new_zeros((num_heads, p, n)) if fresh else state[slot].float().clone()
        for t in range(lo, hi):
            s = s * decay[t][:, None, None] + (step[t][:, None] * xs[t])[:, :, None] * bs[t][:, None, :]
            out[t] = (s * cs[t][:, None, :]).sum(-1) + dd * xs[t]
        if slot >= 0 and hi > lo:
            state[slot] = s
    return out.reshape(t_all, num_heads * p).to(x.dtype)
