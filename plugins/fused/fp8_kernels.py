"""Triton kernels that emit an FP8 linear layer's input: the activation quantized to E4M3 with its static scale
inside the kernel that produces it (RMSNorm, RMSNorm + residual, SwiGLU), or alone where nothing fusable precedes
the linear (attention's output, the lm_head's rows).

Each computes exactly what its torch op computes (:mod:`llmc.runtime.workers.cuda.ops`: the activation rounded to
its dtype where the op rounds), then ``E4M3(x / scale)``: float32 division rounded to nearest, codes rounded to
nearest-even and saturated to ±448 (the quantize expression of ``Fp8Linear`` and ONNX ``QuantizeLinear``), written
as uint8 codes (``torch._scaled_mm`` reads them as ``float8_e4m3fn``). The codec is the portable one of the
PagedAttention kernel (bit-exact under the interpreter and on sm_80). ``scale_ptr``: one float32 on the device,
prepared at load (a CUDA graph keeps its address).

Launch contract (the AOT entry takes exactly the non-constexpr parameters, in order):

- ``rms_norm_fp8_kernel(x, skip, w, scale, codes, sum_out, n_rows)``: grid ``(n_rows,)``, as ``rms_norm_kernel``.
- ``swiglu_fp8_kernel(gate, up, scale, codes, n_rows, g_stride, u_stride)``: grid ``(n_rows, cdiv(N, BLOCK))``.
- ``fp8_quantize_kernel(x, scale, codes, n_rows, x_stride)``: grid ``(n_rows, cdiv(N, BLOCK))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmc.plugins.paged_attention.triton_kernel import _fp8_encode


@triton.jit
def _codes(y, scale_ptr):
    return _fp8_encode(tl.math.div_rn(y.to(tl.float32), tl.load(scale_ptr)))


@triton.jit
def rms_norm_fp8_kernel(x_ptr, skip_ptr, w_ptr, scale_ptr, out_ptr, sum_ptr, n_rows,
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
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act = (y * w).to(x_ptr.dtype.element_ty)  # the norm's output as the torch op rounds it, then quantized
    tl.store(out_ptr + row * N + offs, _codes(act, scale_ptr), mask=ok)


@triton.jit
def swiglu_fp8_kernel(g_ptr, u_ptr, scale_ptr, out_ptr, n_rows, g_stride, u_stride, N: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(g_ptr + row * g_stride + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, _codes((a * u).to(g_ptr.dtype.element_ty), scale_ptr), mask=ok)


@triton.jit
def fp8_quantize_kernel(x_ptr, scale_ptr, out_ptr, n_rows, x_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * N + offs, _codes(x, scale_ptr), mask=ok)
