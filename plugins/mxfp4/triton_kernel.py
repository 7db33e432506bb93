"""``Mxfp4MoEMatMul`` on the GPU: a grouped Triton kernel over the experts' stored MXFP4 codes and E8M0 scales.

The torch op (:func:`llmc.runtime.workers.cuda.ops.mxfp4_moe_matmul`) gathers each routed row's whole expert and
decodes it: ``M x N x K`` weights written per call. Here the routed rows are grouped by expert instead: the caller
sorts the expert ids (``torch.sort``, on the device: no host sync, a CUDA graph captures it) and every program
finds its expert and rows from the sorted ids alone (a vectorised binary search per expert, in the kernel), then
reads its ``BLOCK_N`` columns of that expert's codes once, K block by K block, for all of its ``BLOCK_M`` rows
(gathered through the sort's permutation, results scattered back to the rows' places): the codes are read once per
expert and row block, never decoded into memory.

Values: ``W[e, n, k] = E2M1(code) * 2^(scale - 127)`` computed in float32 from the code bits (exact: a 3-bit
significand times a power of two), rounded to the activation dtype (exact over the exponents a checkpoint uses, as
the torch op's decode), products summed in float32 (IEEE float32 for a float32 engine, not TF32), the result rounded
to the activation dtype once.

Launch contract (the AOT entry takes exactly the non-constexpr parameters, in order):

- ``mxfp4_moe_kernel(x, sorted_ids, order, blocks, scales, out, m_rows, x_stride, steps)``: ``x`` rows ``x_stride``
  apart (``[M, K]``), ``sorted_ids`` / ``order`` int64 ``[M]`` (``torch.sort`` of the rows' expert ids),
  ``blocks [E, N, K/32, 16]`` / ``scales [E, N, K/32]`` uint8 as stored, ``out`` contiguous ``[M, N]``; ``steps``:
  ``m_rows.bit_length()`` (the binary search's iterations); grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M) + min(E, M))``
  (row blocks of all experts together are at most that many; programs past the last exit at once).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lower_bound(sorted_ptr, m_rows, steps, target):
    """For each value of ``target``: the first index of ``sorted_ptr[:m_rows]`` whose value is not below it."""
    lo = tl.zeros(target.shape, dtype=tl.int32)
    hi = lo + m_rows
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=active, other=0)
        right = active & (v < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & (v >= target), mid, hi)
    return lo


@triton.jit
def mxfp4_moe_kernel(x_ptr, ids_ptr, order_ptr, blocks_ptr, scales_ptr, out_ptr, m_rows, x_stride, steps,
                     E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    experts = tl.arange(0, E_PAD)
    # each expert's rows in the sorted order, [starts, ends); experts past E (padding) have none
    starts = _lower_bound(ids_ptr, m_rows, steps, experts.to(tl.int64))
    ends = _lower_bound(ids_ptr, m_rows, steps, experts.to(tl.int64) + 1)
    blocks_of = tl.where(experts < E, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    last = tl.cumsum(blocks_of, 0)  # one past each expert's last row block, over all experts' row blocks
    if pid_b < tl.max(last, 0):
        e = tl.sum((last <= pid_b).to(tl.int32), 0)  # this program's expert: the first whose blocks pass pid_b
        mine = experts == e
        first_block = tl.sum(tl.where(mine, last - blocks_of, 0), 0)
        row0 = tl.sum(tl.where(mine, starts, 0), 0) + (pid_b - first_block) * BLOCK_M
        row_end = tl.sum(tl.where(mine, ends, 0), 0)
        offs_r = row0 + tl.arange(0, BLOCK_M)
        r_ok = offs_r < row_end
        src = tl.load(order_ptr + offs_r, mask=r_ok, other=0)  # the rows' places in x and out
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_rows = (e.to(tl.int64) * N + offs_n) * (K // 2)  # byte offsets of the expert's columns' codes
        s_rows = (e.to(tl.int64) * N + offs_n) * (K // 32)
        offs_h = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            packed = tl.load(blocks_ptr + w_rows[:, None] + (k0 // 2 + offs_h)[None, :], mask=n_ok[:, None], other=0)
            # byte j holds k = 2j (low nibble) and 2j + 1 (high): join then flatten puts them in that order
            c = tl.reshape(tl.join(packed & 0x0F, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.int32)
            ex = (c >> 1) & 3
            half = (c & 1).to(tl.float32) * 0.5
            # E2M1: exponent field 0 -> m / 2 (0 or 0.5); else (1 + m / 2) * 2^(e - 1); bit 3 the sign
            mag = tl.where(ex == 0, half, (1.0 + half) * tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0)))
            val = tl.where((c & 8) != 0, -mag, mag)
            s = tl.load(scales_ptr + s_rows[:, None] + (k0 // 32 + offs_g)[None, :], mask=n_ok[:, None],
                        other=127).to(tl.int32)
            # E8M0 2^(s - 127) as float32 bits: the exponent field itself; s = 0 is the subnormal 2^-127
            pow2 = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
            w = tl.reshape(tl.reshape(val, (BLOCK_N, BLOCK_K // 32, 32)) * pow2[:, :, None], (BLOCK_N, BLOCK_K))
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + src[:, None] * x_stride + offs_k[None, :], mask=r_ok[:, None], other=0.0)
            if x_ptr.dtype.element_ty == tl.float32:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
        tl.store(out_ptr + src[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])
