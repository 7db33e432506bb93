"""Triton kernels of the recurrent-state ops for the CUDA engine, reading and writing the state pool by slot.

Semantics are :mod:`.reference`'s (and :mod:`.torch_reference`'s, slot ``-1``: a zero state, nothing stored). Every
kernel takes the packed rows of a step and the metadata ``state_slots``, ``context_lens``, ``query_start_loc`` (int64),
and runs one program per (sequence, head or channel block): a program walks its sequence's rows in order with the
state in registers (float32), so prefill and decode are one kernel; the state is read once (unless the sequence is
fresh) and written once. Inputs are contiguous rows in the activation dtype; the pool is float32.

- ``causal_conv1d_kernel``: grid ``(num_seqs, cdiv(C, BLOCK_C))``; ``x``/``out`` ``[T, C]``, ``w`` ``[C, K]``,
  ``bias`` ``[C]``, state ``[slots, C, K-1]``.
- ``gated_delta_kernel``: grid ``(num_seqs, HV, cdiv(DV, BLOCK_V))``; ``q``/``k`` ``[T, HK*DK]``, ``v``/``out``
  ``[T, HV*DV]``, ``g``/``beta`` ``[T, HV]``, state ``[slots, HV, DK, DV]``.
- ``ssd_scan_kernel``: grid ``(num_seqs, H, cdiv(P, BLOCK_P))``; ``x``/``out`` ``[T, H*P]``, ``b``/``c``
  ``[T, G*N]``, ``dt`` ``[T, H]``, ``a_log``/``d``/``dt_bias`` ``[H]``, state ``[slots, H, P, N]``.

The recurrences run token by token (the recurrent form); a long prefill is sequential per program, which
``num_seqs x heads x value blocks`` programs keep busy on a GPU for batched work. Held to the references under the
Triton interpreter (tests/test_hybrid_cuda.py); compiled ahead of time by :mod:`llmc.plugins.triton_aot`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, bias_ptr, slot_ptr, ctx_ptr, qsl_ptr, state_ptr, out_ptr,
                         C: tl.constexpr, K: tl.constexpr, KM1_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SILU: tl.constexpr, BLOCK_C: tl.constexpr):
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(slot_ptr + s)
    b = tl.load(qsl_ptr + s)
    e = tl.load(qsl_ptr + s + 1)
    n = e - b
    carry = (tl.load(ctx_ptr + s) != n) & (slot >= 0)  # continues from its slot (else: a zero state)
    st = state_ptr + slot * (C * (K - 1)) + c * (K - 1)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    for t in range(b, e):  # b, e int64: so are the row offsets
        acc = bias
        for j in tl.static_range(K):
            p = t - (K - 1) + j  # the input row tap j reads; before b: the slot's (oldest first)
            xv = tl.load(x_ptr + p * C + c, mask=cm & (p >= b), other=0.0).to(tl.float32)
            sv = tl.load(st + (p - b + (K - 1)), mask=cm & (p < b) & carry, other=0.0)
            acc += tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32) * (xv + sv)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * C + c, acc.to(out_ptr.dtype.element_ty), mask=cm)
    # the slot keeps the last K-1 inputs: rows of this step, or (a short step) the older ones shifted down
    i = tl.arange(0, KM1_PAD)
    live = i < K - 1
    p = e - (K - 1) + i
    from_x = (p >= b) & live
    xv = tl.load(x_ptr + p[None, :] * C + c[:, None], mask=cm[:, None] & from_x[None, :],
                 other=0.0).to(tl.float32)
    sv = tl.load(st[:, None] + (n + i)[None, :], mask=cm[:, None] & (live & ~from_x)[None, :] & carry, other=0.0)
    tl.debug_barrier()  # every old value is read before any is overwritten (another thread may own it)
    tl.store(st[:, None] + i[None, :], xv + sv, mask=cm[:, None] & live[None, :] & (slot >= 0))


@triton.jit
def gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, ctx_ptr, qsl_ptr, state_ptr, out_ptr,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                       BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, SCALE: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HV // HK)
    kk = tl.arange(0, DK_PAD)
    km = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    slot = tl.load(slot_ptr + s)
    b = tl.load(qsl_ptr + s)
    e = tl.load(qsl_ptr + s + 1)
    carry = (tl.load(ctx_ptr + s) != e - b) & (slot >= 0)
    st = state_ptr + slot * (HV * DK * DV) + h * (DK * DV) + kk[:, None] * DV + vv[None, :]
    m2 = km[:, None] & vm[None, :]
    S = tl.load(st, mask=m2 & carry, other=0.0)
    for t in range(b, e):
        q = tl.load(q_ptr + t * (HK * DK) + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * (HK * DK) + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * SCALE
        v = tl.load(v_ptr + t * (HV * DV) + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * HV + h).to(tl.float32)
        beta = tl.load(beta_ptr + t * HV + h).to(tl.float32)
        S = S * tl.exp(g)
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(out_ptr + t * (HV * DV) + h * DV + vv, o.to(out_ptr.dtype.element_ty), mask=vm)
    tl.store(st, S, mask=m2 & (slot >= 0) & (e > b))


@triton.jit
def ssd_scan_kernel(x_ptr, b_ptr, c_ptr, dt_ptr, alog_ptr, d_ptr, dtb_ptr, slot_ptr, ctx_ptr, qsl_ptr, state_ptr,
                    out_ptr, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                    N_PAD: tl.constexpr, BLOCK_P: tl.constexpr, DT_MIN: tl.constexpr, DT_MAX: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // (H // G)
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = pp < P
    nn = tl.arange(0, N_PAD)
    nm = nn < N
    slot = tl.load(slot_ptr + s)
    lo = tl.load(qsl_ptr + s)
    hi = tl.load(qsl_ptr + s + 1)
    carry = (tl.load(ctx_ptr + s) != hi - lo) & (slot >= 0)
    st = state_ptr + slot * (H * P * N) + h * (P * N) + pp[:, None] * N + nn[None, :]
    m2 = pm[:, None] & nm[None, :]
    S = tl.load(st, mask=m2 & carry, other=0.0)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dd = tl.load(d_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(lo, hi):
        x = tl.load(x_ptr + t * (H * P) + h * P + pp, mask=pm, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + t * (G * N) + grp * N + nn, mask=nm, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + t * (G * N) + grp * N + nn, mask=nm, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * H + h).to(tl.float32) + dtb
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))  # torch's softplus
        dt = tl.minimum(tl.maximum(dt, DT_MIN), DT_MAX)
        S = S * tl.exp(dt * a) + (dt * x)[:, None] * bv[None, :]
        y = tl.sum(S * cv[None, :], axis=1) + dd * x
        tl.store(out_ptr + t * (H * P) + h * P + pp, y.to(out_ptr.dtype.element_ty), mask=pm)
    tl.store(st, S, mask=m2 & (slot >= 0) & (hi > lo))
