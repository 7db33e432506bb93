"""Triton kernels that fuse a CUDA engine's small per-layer ops: RMSNorm (with the residual add), rotary, SwiGLU.

Each replaces several torch kernels of :mod:`llmc.runtime.workers.cuda.ops` (an RMSNorm in torch is about
nine launches, a rotary about twelve) with one, and computes exactly what that op computes:
float32 arithmetic, rounded to the activation dtype where the torch op rounds. On a GPU they run as
cubins compiled ahead of time (:mod:`llmc.plugins.triton_aot`); on the CPU, under the Triton
interpreter, the tests hold them to the torch ops.

Launch contract (the AOT entry takes exactly the non-constexpr parameters, in order):

- ``rms_norm_kernel(x, skip, w, out, sum_out, n_rows)``: grid ``(n_rows,)``; rows of ``N`` contiguous
  elements; ``HAS_SKIP`` adds ``skip`` first and stores the rounded sum to ``sum_out``.
- ``rotary_kernel(x, cos, sin, out, n_tokens, x_stride)``: grid ``(n_tokens, H)``; ``x`` rows ``x_stride``
  elements apart (a view of the packed QKV projection), ``cos``/``sin`` ``[n_tokens, D/2]`` float32,
  ``out`` contiguous ``[n_tokens, H*D]``; rotate-half over the whole head.
- ``swiglu_kernel(gate, up, out, n_rows, g_stride, u_stride)``: grid ``(n_rows, cdiv(N, BLOCK))``;
  ``out`` contiguous ``[n_rows, N]``.
- ``int4_matmul_kernel(x, q, s, z, out, part, m_rows, x_stride, split_k, chunk)``: grid
  ``(cdiv(N, BLOCK_N), split_k, cdiv(m_rows, BLOCK_M))``, any row count; ``split_k`` and ``chunk`` from
  :func:`llmc.plugins.fused.requests.int4_launch` (``out`` when ``split_k`` is 1, else float32 ``part``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, skip_ptr, w_ptr, out_ptr, sum_ptr, n_rows,
                    N: tl.constexpr, BLOCK: tl.constexpr, EPS: tl.constexpr, HAS_SKIP: tl.constexpr,
                    ROUND_Y: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0)
    if HAS_SKIP:
        s = (x.to(tl.float32) + tl.load(skip_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32))
        x = s.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + offs, x, mask=ok)
    x32 = x.to(tl.float32)
    ms = tl.sum(x32 * x32, axis=0) / N
    y = x32 * (1.0 / tl.sqrt(ms + EPS))
    if ROUND_Y:  # a low-precision weight: transformers rounds the normalized row first, then multiplies
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens, x_stride,
                  H: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF_PAD)
    ok = offs < HALF
    base = x_ptr + t * x_stride + h * D
    x1 = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + offs, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t * HALF + offs, mask=ok, other=0.0)
    o = out_ptr + t * (H * D) + h * D
    tl.store(o + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o + HALF + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, out_ptr, n_rows, g_stride, u_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + row * g_stride + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=ok, other=0.0).to(tl.float32)
    # torch: silu(g) rounded to the activation dtype, then the product rounded
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def int4_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, part_ptr, m_rows, x_stride, split_k, chunk,
                       N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZERO: tl.constexpr):
    """W4A16: ``out[M, N] = x[M, K] @ W`` with ``W`` as two 4-bit codes per byte ``q [ceil(K/2), N]`` (row 2i
    in the low nibble), group scales ``s [ceil(K/G), N]`` and (``HAS_ZERO``) zero points ``z`` (uint8); without
    them the codes are signed. Program ``(n, k, m)`` covers ``BLOCK_N`` columns, ``BLOCK_M`` rows and ``chunk``
    (a multiple of ``BLOCK_K``, which divides ``GROUP``) rows of ``K``: ``split_k == 1`` stores ``out`` in the
    activation dtype, else float32 partial sums ``part [split_k, M, N]`` (summed by the caller). The split is a
    launch argument, not a constant: the host picks it from the row count (:func:`..requests.int4_launch`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_K // 2)
    m_ok = offs_m < m_rows
    n_ok = offs_n < N
    rows_x = offs_m.to(tl.int64) * x_stride  # 64-bit: a long prefill chunk times a wide K passes 2^31 elements
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * chunk
    for k0 in range(k_lo, tl.minimum(k_lo + chunk, K), BLOCK_K):
        rows = k0 // 2 + offs_h
        packed = tl.load(q_ptr + rows[:, None] * N + offs_n[None, :],
                         mask=(rows[:, None] < (K + 1) // 2) & n_ok[None, :], other=0)
        lo = (packed & 0x0F).to(tl.int32)
        hi = (packed >> 4).to(tl.int32)
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))
        g = k0 // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(z_ptr + g * N + offs_n, mask=n_ok, other=0).to(tl.int32)
            wf = (w - z[None, :]).to(tl.float32) * s[None, :]
        else:
            wf = tl.where(w >= 8, w - 16, w).to(tl.float32) * s[None, :]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_x[:, None] + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        # the weight rounded to the activation dtype once, as the torch op's dequantized weight is; a float32 engine
        # (parity tests) multiplies in IEEE float32, not TF32
        if x_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(x, wf, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, wf.to(x_ptr.dtype.element_ty), acc)
    o = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if split_k == 1:
        tl.store(out_ptr + o, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * m_rows * N + o, acc, mask=ok)
