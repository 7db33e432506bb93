"""GPU kernel of PagedAttention, in Triton: one launch writes the new K/V into the cache and attends.

Same semantics as :func:`llmc.plugins.paged_attention.reference.paged_attention` (normative) for
packed steps that mix prefill chunks and decodes: GQA (query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``), causal masking, optional sliding window and soft-capping,
the caller's ``scale``, optional attention sinks (``sinks [num_heads]``: ``exp(sinks[h])`` joins
head ``h``'s softmax denominator once, after the split-KV combine), optional bidirectional spans
(``attend_end [T]`` int64: row ``t`` at position ``q`` also sees the keys ``q < k < attend_end[t]``); KV caches
``[num_blocks, num_kv_heads, block_size, head_size]`` (layout ``blocks_hnd``) in the model dtype, in
float16 under float32 activations, or in FP8.

FP8 KV cache (``uint8`` caches holding E4M3FN codes, ``kv_scales = [k_scale, v_scale]`` float32):
a new row is stored as ``E4M3(x / scale)``, rounded to nearest-even and saturated to ±448 (what
ONNX ``QuantizeLinear(saturate=1)`` computes, so the CPU graph's Q/DQ emulation and this kernel
hold the same values), and read back as ``decode(code) * scale``.

How one launch can both write and read the cache: each program owns a tile of one sequence's new
query rows and one KV head. It stores its own rows' K/V, and reads positions older than this step
from the cache but this step's positions straight from the ``key``/``value`` inputs, rounded
through the cache's storage format, so no program ever reads a slot another program is writing
(this is also how a row sees the keys ahead of it that ``attend_end`` opens: they are this step's rows).
That relies on what every block manager guarantees and the reference assumes: the new token at
position ``p`` of sequence ``s`` has slot ``block_tables[s, p // block_size] * block_size +
p % block_size``, and no slot written in a step is read as an older position in the same step.
Rows past ``query_start_loc[-1]`` (padding) are neither written to the cache nor given an output
by the kernel; :func:`paged_attention` returns zeros there, as the reference does.

Grid: axis 0 enumerates query tiles; sequence ``s`` owns tiles ``query_start_loc[s] // BLOCK_Q + s``
onwards (at least ``ceil(n_s / BLOCK_Q)`` of them; a program finds its sequence by binary search),
so ``cdiv(T, BLOCK_Q) + S`` programs always suffice and the grid is a function of tensor shapes
only, which is what TensorRT needs from an ahead-of-time kernel. Axis 1 is the KV head, axis 2
the KV split (flash-decoding: with ``num_splits > 1`` each program covers a slice of the context
and a second kernel combines the partial softmaxes; for batches too small to fill the GPU).

Tiles pack ``BLOCK_Q`` tokens x ``group`` query heads into ``BLOCK_M`` rows, so each K/V tile is
loaded once per KV head. Kernel arguments are ordered inputs, int32 scalars, outputs (what
TensorRT's AOT plugin launch passes); float attributes are compile-time constants.

The kernels also run on the CPU under ``TRITON_INTERPRET=1`` (set before triton is imported): CPU
tensors run in the interpreter, CUDA tensors compiled (see :func:`interpreted`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

import triton
import triton.language as tl

FP8_MAX = 448.0


# --------------------------------------------------------------------------------------------
# FP8 E4M3FN, bit-exact and portable (the interpreter's float8 casts neither round nor saturate
# like the hardware, and sm_80 has no FP8 conversion instructions).


@triton.jit
def _fp8_encode(x):
    """float32 -> uint8 E4M3FN code: round to nearest-even, saturate to ±448, NaN -> 0x7F."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): round the 23-bit mantissa to 3 bits, ties to even, then rebias 127 -> 7.
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormal range: multiples of 2^-9, rounded half to even (t < 16, so the int conversion is exact).
    t = tl.minimum(a, 1.0) * 512.0
    ti = t.to(tl.int32)
    frac = t - ti.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ti & 1) == 1))
    code = tl.where(a < 0.015625, ti + up.to(tl.int32), normal)
    code = tl.minimum(code, 0x7E)
    code = tl.where(x != x, 0x7F, code)
    code = code | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign bit, -0.0 included
    return code.to(tl.uint8)


@triton.jit
def _fp8_decode(code, NATIVE: tl.constexpr):
    """uint8 E4M3FN code -> float16 (exact: every E4M3 value is a float16)."""
    if NATIVE:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        c = code.to(tl.uint16)
        # Place sign, exponent and mantissa in float16's fields; 2^8 rebiases 7 -> 15 (subnormals included).
        bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        value = bits.to(tl.float16, bitcast=True) * 256.0
        return tl.where((c & 0x7F) == 0x7F, float("nan"), value).to(tl.float16)


@triton.jit
def _store_kv(ptr, x, scale, mask, FP8: tl.constexpr):
    if FP8:
        tl.store(ptr, _fp8_encode(tl.math.div_rn(x.to(tl.float32), scale)), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _as_stored(x, scale, cache_ptr, FP8: tl.constexpr, NATIVE: tl.constexpr):
    """New K/V rows as the cache will hold them (FP8: the codes, decoded; scale applied later)."""
    if FP8:
        return _fp8_decode(_fp8_encode(tl.math.div_rn(x.to(tl.float32), scale)), NATIVE)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _from_cache(x, FP8: tl.constexpr, NATIVE: tl.constexpr):
    if FP8:
        return _fp8_decode(x, NATIVE)
    else:
        return x


@triton.jit
def fp8_codec_kernel(x_ptr, codes_in_ptr, scale_ptr, codes_out_ptr, decoded_ptr, n,
                     BLOCK: tl.constexpr, NATIVE: tl.constexpr):
    """codes_out = E4M3(x / scale); decoded = float16(decode(codes_in)). For tests and the GPU check."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    scale = tl.load(scale_ptr)
    tl.store(codes_out_ptr + offs, _fp8_encode(tl.math.div_rn(x, scale)), mask=ok)
    tl.store(decoded_ptr + offs, _fp8_decode(tl.load(codes_in_ptr + offs, mask=ok, other=0), NATIVE), mask=ok)


# --------------------------------------------------------------------------------------------
# Attention


@triton.jit
def _find_seq(qsl_ptr, tile_id, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= tile_id``."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile_id, mid, lo)
        hi = tl.where(start <= tile_id, hi, mid - 1)
    return lo


@triton.jit
def _attend(q, k, v, pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, slope, q_end,
            SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, DOT_TYPE: tl.constexpr, PRECISION: tl.constexpr,
            ALIBI: tl.constexpr, CHUNK: tl.constexpr, ATTEND_END: tl.constexpr):
    """One online-softmax step over a K/V tile. q [M, D], k [D, N], v [N, D]; scores in float32. ``slope`` [M]:
    the rows' ALiBi slopes (read only when ALIBI > 0); ``q_end`` [M]: the rows' attend_end (read only when
    ATTEND_END)."""
    s = tl.dot(q, k.to(DOT_TYPE), input_precision=PRECISION) * qk_scale
    if SOFTCAP > 0:
        # softcap * tanh(s / softcap), with tanh from exp (tl has no tanh; saturates to ±1 correctly).
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / SOFTCAP)) + 1.0))
    if ALIBI > 0:  # slope * (key position - query position), on logical positions
        s = s + slope[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
    if ATTEND_END:  # bidirectional spans: also the keys ahead of the row, up to attend_end - 1
        allowed = pos_ok[None, :] & ((pos[None, :] <= q_pos[:, None]) | (pos[None, :] < q_end[:, None]))
    else:
        allowed = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        allowed = allowed & (pos[None, :] > q_pos[:, None] - WINDOW)
    if CHUNK > 0:  # chunked local attention: the query's own chunk only
        allowed = allowed & (pos[None, :] >= q_pos[:, None] - q_pos[:, None] % CHUNK)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing allowed yet keep m = -inf; use 0 there so exp() sees -inf, never NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TYPE), v.to(DOT_TYPE), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def paged_attention_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, slot_ptr, bt_ptr, ctx_ptr, qsl_ptr, k_cache_ptr, v_cache_ptr, kv_scale_ptr,
    # attention-sink logits [NUM_HEADS] (read only when HAS_SINKS; a constexpr None in kernels without them)
    sinks_ptr,
    # attend_end [T] int64 (read only when HAS_ATTEND_END; a constexpr None in kernels without it)
    attend_end_ptr,
    # int32 scalars
    num_seqs, max_blocks,
    # outputs (the cache outputs alias the cache inputs; new K/V rows are stored through them)
    out_ptr, k_cache_out_ptr, v_cache_out_ptr,
    # split-KV partials (None unless NUM_SPLITS > 1): m, l [T, H, NUM_SPLITS], acc [T, H, NUM_SPLITS, D]
    part_m_ptr, part_l_ptr, part_acc_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, DOT_TYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_Q_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr = False, ALIBI: tl.constexpr = 0.0,
    ALIBI_N: tl.constexpr = 1, CHUNK: tl.constexpr = 0, HAS_ATTEND_END: tl.constexpr = False,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    tile_id = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    s = _find_seq(qsl_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + s)
    n_new = (tl.load(qsl_ptr + s + 1) - q_start).to(tl.int32)
    tile = (tile_id - (q_start // BLOCK_Q + s)).to(tl.int32)
    if tile * BLOCK_Q >= n_new:
        return
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    ctx_old = ctx - n_new
    if FP8:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    else:
        k_scale = 1.0
        v_scale = 1.0

    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE

    # ---- write this tile's new K/V rows for this KV head (once, by split 0)
    if split == 0:
        offs_t = tl.arange(0, BLOCK_Q_PAD)
        t_loc = tile * BLOCK_Q + offs_t
        t_ok = (offs_t < BLOCK_Q) & (t_loc < n_new)
        rows = q_start + t_loc
        slot = tl.load(slot_ptr + rows, mask=t_ok, other=-1)
        w_ok = (t_ok & (slot >= 0))[:, None] & d_ok[None, :]
        src = rows[:, None] * (NUM_KV_HEADS * HEAD_SIZE) + kvh * HEAD_SIZE + offs_d[None, :]
        blk = slot // BLOCK_SIZE
        dst = ((blk * NUM_KV_HEADS + kvh) * BLOCK_SIZE + slot % BLOCK_SIZE)[:, None] * HEAD_SIZE + offs_d[None, :]
        _store_kv(k_cache_out_ptr + dst, tl.load(k_ptr + src, mask=w_ok, other=0.0), k_scale, w_ok, FP8)
        _store_kv(v_cache_out_ptr + dst, tl.load(v_ptr + src, mask=w_ok, other=0.0), v_scale, w_ok, FP8)

    # ---- the tile's query rows: BLOCK_Q tokens x GROUP heads
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < n_new)
    q_pos = ctx_old + tok
    q_off = (q_start + tok)[:, None] * (NUM_HEADS * HEAD_SIZE) + head[:, None] * HEAD_SIZE + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TYPE)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI > 0:
        # ALiBi's standard slopes (reference.alibi_slopes): 2^(-ALIBI (h + 1) / n) for the first n = ALIBI_N
        # heads (the largest power of two <= NUM_HEADS), the odd-indexed slopes of 2n heads for the rest.
        hf = head.to(tl.float32)
        e = tl.where(head < ALIBI_N, (hf + 1.0) / ALIBI_N, (2.0 * (hf - ALIBI_N) + 1.0) / (2 * ALIBI_N))
        slope = tl.exp2(-ALIBI * e)

    # Positions this program covers: up to the tile's last query, from the window's start.
    last_q = tl.minimum(ctx_old + (tile + 1) * BLOCK_Q, ctx) - 1
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx_old + tile * BLOCK_Q - WINDOW + 1, 0)
    if CHUNK > 0:  # the tile's first query's chunk start (later queries' chunks start no earlier)
        first_q = ctx_old + tile * BLOCK_Q
        lo = tl.maximum(lo, first_q - first_q % CHUNK)
    hi = last_q + 1
    q_end = tl.zeros([BLOCK_M], tl.int32)
    if HAS_ATTEND_END:
        # The rows' spans may reach past the tile's last query: cover up to the furthest (never past the context,
        # which the caller guarantees; the clamp keeps a bad value from reading beyond this step's rows).
        q_end = tl.load(attend_end_ptr + q_start + tok, mask=row_ok, other=0).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, tl.max(q_end, 0)), ctx)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(lo + chunk, hi)

    qk_scale = SCALE * k_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Older positions, from the cache through the block table.
    old_hi = tl.minimum(hi, ctx_old)
    for start in range(lo, old_hi, BLOCK_N):
        pos = start + offs_n
        pos_ok = pos < old_hi
        blk = tl.load(bt_ptr + s * max_blocks + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        base = ((blk * NUM_KV_HEADS + kvh) * BLOCK_SIZE + pos % BLOCK_SIZE) * HEAD_SIZE
        kv_ok = pos_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=tl.trans(kv_ok), other=0.0)
        m_i, l_i, acc = _attend(q, _from_cache(k, FP8, FP8_NATIVE), _from_cache(v, FP8, FP8_NATIVE),
                                pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, slope, q_end, SOFTCAP, WINDOW, DOT_TYPE,
                                PRECISION, ALIBI, CHUNK, HAS_ATTEND_END)

    # This step's positions, from the inputs (rounded as the cache stores them).
    for start in range(tl.maximum(lo, ctx_old), hi, BLOCK_N):
        pos = start + offs_n
        pos_ok = pos < hi
        rows = q_start + (pos - ctx_old)
        base = rows * (NUM_KV_HEADS * HEAD_SIZE) + kvh * HEAD_SIZE
        kv_ok = pos_ok[None, :] & d_ok[:, None]
        k = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=tl.trans(kv_ok), other=0.0)
        m_i, l_i, acc = _attend(q, _as_stored(k, k_scale, k_cache_ptr, FP8, FP8_NATIVE),
                                _as_stored(v, v_scale, v_cache_ptr, FP8, FP8_NATIVE),
                                pos, pos_ok, q_pos, m_i, l_i, acc, qk_scale, slope, q_end, SOFTCAP, WINDOW, DOT_TYPE,
                                PRECISION, ALIBI, CHUNK, HAS_ATTEND_END)

    row = (q_start + tok) * NUM_HEADS + head  # index of (token, head)
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            # The sink's exp(sink - m) joins the denominator, against max(m, sink) so neither exponential overflows.
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            top = tl.maximum(m_i, sink)
            a = tl.exp(m_i - top)
            out = acc * (v_scale * a / (l_i * a + tl.exp(sink - top)))[:, None]
        else:
            out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        o_off = row[:, None] * HEAD_SIZE + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(part_m_ptr + row * NUM_SPLITS + split, m_i, mask=row_ok)
        tl.store(part_l_ptr + row * NUM_SPLITS + split, l_i, mask=row_ok)
        a_off = (row * NUM_SPLITS + split)[:, None] * HEAD_SIZE + offs_d[None, :]
        tl.store(part_acc_ptr + a_off, acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def combine_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, kv_scale_ptr, qsl_ptr, num_seqs, out_ptr, sinks_ptr,
                          NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, HAS_SINKS: tl.constexpr = False):
    """out[t, h] = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i over the splits of row (t, h); with sinks,
    ``exp(sinks[h] - M)`` joins the denominator here, once (the splits hold plain partial sums)."""
    t = tl.program_id(0)
    if t >= tl.load(qsl_ptr + num_seqs):
        return  # padding row: left as the caller initialised it
    h = tl.program_id(1)
    row = t.to(tl.int64) * NUM_HEADS + h
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    m = tl.load(part_m_ptr + row * NUM_SPLITS + offs_s)
    lsum = tl.load(part_l_ptr + row * NUM_SPLITS + offs_s)
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_SIZE + offs_d[None, :],
                  mask=d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)  # finite: the split holding the row's own position saw it
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    denom = tl.sum(lsum * w, 0)
    if HAS_SINKS:
        denom = denom + tl.exp(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denom
    if FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    tl.store(out_ptr + row * HEAD_SIZE + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# --------------------------------------------------------------------------------------------
# Configuration shared by the launcher and the ahead-of-time compiler


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time constants of one specialisation of :func:`paged_attention_kernel`.

    ``cache_dtype``/``act_dtype`` are Triton type names (``fp16``, ``bf16``, ``fp32``; ``u8`` cache
    = FP8 E4M3 codes). ``block_m`` rows per program (tokens x group heads), ``block_n`` KV
    positions per inner step.
    """

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    scale: float
    act_dtype: str = "fp16"
    cache_dtype: str = "fp16"
    sliding_window: int = 0
    softcap: float = 0.0
    block_m: int = 16
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False
    fp8_native: bool = False  # hardware E4M3 -> f16 conversion (sm_89+); off in the interpreter
    sinks: bool = False  # attention sinks: the kernel reads sinks_ptr [num_heads]
    alibi_max_bias: float = 0.0  # > 0: ALiBi with the standard slopes of this maximum bias
    attention_chunk: int = 0  # > 0: chunked local attention (keys from floor(p / C) * C)
    attend_end: bool = False  # bidirectional spans: the kernel reads attend_end_ptr [T] int64

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.block_m < self.group:
            object.__setattr__(self, "block_m", triton.next_power_of_2(self.group))
        for name in ("block_m", "block_n", "num_splits"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError("block_m and block_n must be at least 16 (tl.dot)")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "u8"

    @property
    def block_q(self) -> int:
        return self.block_m // self.group

    def dot_type(self):
        # The interpreter computes in numpy, which has no bfloat16: upcast there. On a GPU, tensor
        # cores take 16-bit inputs (FP8 codes decode exactly to float16, or to bfloat16 when the
        # activations are bfloat16); float32 stays float32 with IEEE products (no TF32).
        if self.interpret or self.act_dtype == "fp32":
            return tl.float32
        return tl.bfloat16 if self.act_dtype == "bf16" else tl.float16

    def constexprs(self) -> dict:
        return dict(
            NUM_HEADS=self.num_heads, NUM_KV_HEADS=self.num_kv_heads, HEAD_SIZE=self.head_size,
            HEAD_PAD=max(16, triton.next_power_of_2(self.head_size)), BLOCK_SIZE=self.block_size,
            SCALE=float(self.scale), SOFTCAP=float(self.softcap), WINDOW=int(self.sliding_window),
            FP8=self.fp8, FP8_NATIVE=self.fp8_native and not self.interpret, DOT_TYPE=self.dot_type(),
            PRECISION="ieee" if self.dot_type() == tl.float32 else "tf32",
            BLOCK_M=self.block_m, BLOCK_Q=self.block_q, BLOCK_Q_PAD=triton.next_power_of_2(self.block_q),
            BLOCK_N=self.block_n, NUM_SPLITS=self.num_splits, HAS_SINKS=self.sinks,
            ALIBI=float(self.alibi_max_bias), ALIBI_N=1 << (self.num_heads.bit_length() - 1),
            CHUNK=int(self.attention_chunk), HAS_ATTEND_END=self.attend_end,
        )

    def grid(self, num_tokens: int, num_seqs: int) -> tuple[int, int, int]:
        """Programs to launch: ``(cdiv(T, BLOCK_Q) + S, num_kv_heads, num_splits)``."""
        return (triton.cdiv(num_tokens, self.block_q) + num_seqs, self.num_kv_heads, self.num_splits)


# --------------------------------------------------------------------------------------------
# Interpreter or compiler


def interpreted() -> bool:
    """Whether this process runs Triton kernels in the interpreter.

    ``triton.jit`` decides when a function is decorated, from ``TRITON_INTERPRET``, and Triton's
    own library functions (``tl.sum``, ``tl.zeros``, ...) are decorated when ``triton`` is first
    imported: one process is either interpreting or compiling, for good.
    """
    return type(paged_attention_kernel).__name__ == "InterpretedFunction"


def kernels(interpret: bool) -> ModuleType:
    """This module, after checking that its kernels run the way the caller needs."""
    if interpreted() != interpret:
        if interpret:
            raise RuntimeError(
                "CPU tensors need the Triton interpreter, but this process imported triton without it: "
                "set TRITON_INTERPRET=1 before triton is first imported (tests/conftest.py does)")
        raise RuntimeError(
            "CUDA tensors need compiled Triton kernels, but this process runs the Triton interpreter "
            "(TRITON_INTERPRET=1 was set when triton was imported): unset it")
    return sys.modules[__name__]


# --------------------------------------------------------------------------------------------
# Launcher


_TORCH_TO_TL = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "uint8": "u8", "float8_e4m3fn": "u8"}


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                      block_n: int = 64) -> int:
    """Split the context (flash-decoding) when ``S * Hkv`` programs cannot fill ``num_sms`` SMs.

    Aims at about two programs per SM, each covering at least 4 ``block_n`` tiles; a power of two.
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, (2 * num_sms) // programs)
    most = max(1, max_context_len // (4 * block_n))
    n = min(want, most, 64)
    return 1 << (n.bit_length() - 1)


def paged_attention(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                    k_cache, v_cache, *, num_heads: int, num_kv_heads: int, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0, kv_scales=None, num_splits: int = 1,
                    block_m: int | None = None, block_n: int | None = None, num_warps: int = 4, out=None,
                    sinks=None, alibi_max_bias: float = 0.0, attention_chunk: int = 0, attend_end=None):
    """Write the new K/V into the caches in place, then attend. Returns ``[T, num_heads * head_size]``.

    Torch tensors, all on one device (CUDA, or CPU to run under the Triton interpreter):
    ``query [T, Hq*D]``, ``key``/``value [T, Hkv*D]`` (float16/bfloat16/float32), ``slot_mapping [T]``,
    ``block_tables [S, max_blocks]``, ``context_lens [S]``, ``query_start_loc [S+1]`` (int64 or
    int32), caches ``[num_blocks, Hkv, block_size, D]`` contiguous, in the activation dtype,
    float16, or ``uint8``/``float8_e4m3fn`` for an FP8 cache with ``kv_scales`` = ``[k_scale,
    v_scale]`` (float32 tensor, or a pair of floats). ``num_splits > 1`` splits each sequence's
    context over that many programs (see :func:`choose_num_splits`). ``sinks``: None, or attention-sink
    logits ``[num_heads]`` (any float dtype, read as float32). ``alibi_max_bias`` > 0: ALiBi with the standard
    slopes; ``attention_chunk`` > 0: chunked local attention; ``attend_end``: None, or ``[T]`` integers,
    bidirectional spans, each ``<= context_lens`` of the row's sequence (see ``reference.paged_attention``).
    Output dtype = query's.
    """
    import torch

    t_rows, s_count = query.shape[0], context_lens.shape[0]
    _, hkv, block_size, head_size = k_cache.shape
    if hkv != num_kv_heads:
        raise ValueError(f"k_cache has {hkv} KV heads, num_kv_heads is {num_kv_heads}")
    for name, tensor in (("query", query), ("key", key), ("value", value), ("k_cache", k_cache),
                         ("v_cache", v_cache), ("block_tables", block_tables)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    interpret = query.device.type == "cpu"
    fp8 = k_cache.dtype == torch.uint8
    if fp8:
        if kv_scales is None:
            raise ValueError("an FP8 (uint8) KV cache needs kv_scales = [k_scale, v_scale]")
        kv_scales = torch.as_tensor(kv_scales, dtype=torch.float32, device=query.device).reshape(2)
    fp8_native = fp8 and not interpret and torch.cuda.get_device_capability(query.device) >= (8, 9)
    decode_only = t_rows <= s_count  # every sequence has at most one new row (known from shapes alone)
    cfg = KernelConfig(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
        scale=scale, act_dtype=_TORCH_TO_TL[str(query.dtype).split(".")[-1]],
        cache_dtype=_TORCH_TO_TL[str(k_cache.dtype).split(".")[-1]], sliding_window=sliding_window,
        softcap=softcap, block_m=block_m or (16 if decode_only else 64),
        block_n=block_n or (32 if interpret else 64), num_splits=num_splits, num_warps=num_warps,
        interpret=interpret, fp8_native=fp8_native, sinks=sinks is not None,
        alibi_max_bias=float(alibi_max_bias), attention_chunk=int(attention_chunk),
        attend_end=attend_end is not None,
    )
    if sinks is not None:
        sinks = sinks.reshape(-1).contiguous()
        if sinks.shape[0] != num_heads:
            raise ValueError(f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
    if attend_end is not None:
        attend_end = attend_end.reshape(-1).to(torch.int64).contiguous()
        if attend_end.shape[0] != t_rows:
            raise ValueError(f"attend_end must have one entry per query row ({t_rows}), got shape "
                             f"{tuple(attend_end.shape)}")
    mod = kernels(interpret)
    if out is None:
        out = torch.zeros((t_rows, num_heads * head_size), dtype=query.dtype, device=query.device)
    if t_rows == 0 or s_count == 0:
        return out
    parts = (None, None, None)
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        parts = (torch.empty((t_rows, num_heads, num_splits), **f32),
                 torch.empty((t_rows, num_heads, num_splits), **f32),
                 torch.empty((t_rows, num_heads, num_splits, head_size), **f32))
    consts = cfg.constexprs()
    mod.paged_attention_kernel[cfg.grid(t_rows, s_count)](
        query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, k_cache, v_cache,
        kv_scales, sinks, attend_end, s_count, block_tables.shape[1], out, k_cache, v_cache, *parts,
        **consts, num_warps=num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        mod.combine_splits_kernel[(t_rows, num_heads)](
            *parts, kv_scales, query_start_loc, s_count, out, sinks, NUM_HEADS=num_heads, HEAD_SIZE=head_size,
            HEAD_PAD=consts["HEAD_PAD"], NUM_SPLITS=num_splits, FP8=fp8, HAS_SINKS=sinks is not None,
            num_warps=num_warps,
        )
    return out


def fp8_codec(x, codes, scale: float):
    """Run the kernel's FP8 encoder on float32 ``x`` (``E4M3(x / scale)``, uint8) and its decoder on
    uint8 ``codes`` (float16), with the same element count. CPU tensors run interpreted."""
    import torch

    interpret = x.device.type == "cpu"
    native = not interpret and torch.cuda.get_device_capability(x.device) >= (8, 9)
    n = x.numel()
    if codes.numel() != n:
        raise ValueError("x and codes must have the same number of elements")
    out_codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    decoded = torch.empty(n, dtype=torch.float16, device=x.device)
    scale_t = torch.tensor([scale], dtype=torch.float32, device=x.device)
    block = 1024
    kernels(interpret).fp8_codec_kernel[(triton.cdiv(n, block),)](
        x.reshape(-1).float(), codes.reshape(-1), scale_t, out_codes, decoded, n, BLOCK=block, NATIVE=native)
    return out_codes.reshape(x.shape), decoded.reshape(codes.shape)


def kv_bytes_read(context_lens, num_kv_heads: int, head_size: int, cache_itemsize: int) -> int:
    """Bytes of K and V a decode step must read at least (each cached position once per KV head)."""
    return int(sum(int(c) for c in context_lens)) * num_kv_heads * head_size * cache_itemsize * 2


__all__ = ["FP8_MAX", "KernelConfig", "choose_num_splits", "combine_splits_kernel", "fp8_codec", "interpreted",
           "kernels", "kv_bytes_read", "paged_attention", "paged_attention_kernel"]
