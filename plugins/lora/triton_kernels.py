"""Triton kernels for LoRA slots chosen per token (Punica's shrink/expand split, one token per program).

The stacked adapters are the CUDA engine's ``<module>.lora_A`` ``[K, S*R]`` and ``<module>.lora_B`` ``[S*R, N]``
(slot ``s`` in column/row block ``s - 1``; see llmc.passes.lora), ``slots`` ``[T]`` int64 (0, -1: no adapter).

- ``lora_shrink_kernel(x, a, slots, u, n_tokens, x_stride)``: grid ``(n_tokens,)``;
  ``u[t, :R] = x[t] @ a[:, (s-1)R : sR]`` in float32 (zeros for a token without adapter); ``u`` ``[T, R]`` float32.
- ``lora_expand_kernel(u, b, slots, y, out, n_tokens, y_stride)``: grid ``(n_tokens, cdiv(N, BLOCK_N))``;
  ``out[t] = y[t] + u[t] @ b[(s-1)R : sR]`` (``y`` untouched for a token without adapter), float32 sums
  rounded once to the activation dtype; ``out`` contiguous ``[T, N]`` (it may be ``y`` itself).

Decode steps are a handful of tokens, so each program streams one token's row against its slot's block: the
work is reading A and B once per token, which is what bounds it. They compute what
:func:`llmc.plugins.lora.reference.lora_apply` computes, held to it under the Triton interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, u_ptr, n_tokens, x_stride,
                       K: tl.constexpr, R: tl.constexpr, S: tl.constexpr, R_PAD: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    r = tl.arange(0, R_PAD)
    acc = tl.zeros([R_PAD], dtype=tl.float32)
    if (slot >= 1) & (slot <= S):
        col = (slot - 1) * R + r
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kk = k < K
            x = tl.load(x_ptr + t * x_stride + k, mask=kk, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + k[:, None] * (S * R) + col[None, :], mask=kk[:, None] & (r[None, :] < R),
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None] * a, axis=0)
    tl.store(u_ptr + t * R + r, acc, mask=r < R)


@triton.jit
def lora_expand_kernel(u_ptr, b_ptr, slot_ptr, y_ptr, out_ptr, n_tokens, y_stride,
                       N: tl.constexpr, R: tl.constexpr, S: tl.constexpr, R_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nn = n < N
    slot = tl.load(slot_ptr + t)
    y = tl.load(y_ptr + t * y_stride + n, mask=nn, other=0.0)
    if (slot >= 1) & (slot <= S):
        r = tl.arange(0, R_PAD)
        rr = r < R
        u = tl.load(u_ptr + t * R + r, mask=rr, other=0.0)
        b = tl.load(b_ptr + ((slot - 1) * R + r)[:, None] * N + n[None, :], mask=rr[:, None] & nn[None, :],
                    other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + tl.sum(u[:, None] * b, axis=0)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * N + n, y, mask=nn)
