"""Triton kernels of a vision encoder's per-layer ops in the CUDA engine: LayerNorm (with bias) and GELU.

A ViT layer (CLIP, SigLIP, Pixtral's projector) normalises with LayerNorm and activates with GELU; in torch each is
several kernels. These compute what :mod:`llmc.runtime.workers.cuda.ops`' ``LayerNormalization`` and ``Gelu``
compute (float32 arithmetic, one rounding to the activation dtype at the store), compiled ahead of time with the
encoder's program (:func:`llmc.compiler.backends.cuda.emit_graph`); on the CPU the tests run them under the Triton
interpreter against those ops.

Launch contract (the AOT entry takes the non-constexpr parameters, in order):

- ``layer_norm_kernel(x, w, b, out, n_rows)``: grid ``(n_rows,)``; rows of ``N`` contiguous elements; ``HAS_BIAS``
  off: ``b`` is not read (pass ``w``).
- ``gelu_kernel(x, out, n_rows)``: grid ``(n_rows, cdiv(N, BLOCK))``; rows of ``N`` contiguous elements; ``TANH``:
  the tanh approximation (``approximate="tanh"``), else the exact erf form.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_rows,
                      N: tl.constexpr, BLOCK: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    d = tl.where(ok, x - mean, 0.0)
    var = tl.sum(d * d, axis=0) / N
    y = d * (1.0 / tl.sqrt(var + EPS)) * tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gelu_kernel(x_ptr, out_ptr, n_rows, N: tl.constexpr, BLOCK: tl.constexpr, TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    if TANH:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x * (1.0 - 1.0 / (tl.exp(2.0 * u) + 1.0))  # 0.5 x (1 + tanh u), tanh u = 1 - 2 / (e^2u + 1)
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)
