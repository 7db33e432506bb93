"""FlashAttention-2-style prefill and split-KV (flash-decoding) decode kernels of PagedAttention, in Triton.

The CUDA engine's attention (issue 51 item 4), compiled ahead of time like the other kernels
(:mod:`.flash_requests` builds the requests, :mod:`llmc.plugins.triton_aot` compiles them) and launched by
:func:`.flash_requests.run_attention`. Same semantics as :func:`.reference.paged_attention` (normative) and as the
first kernel (:mod:`.triton_kernel`, which TensorRT's plugin still uses): packed steps, GQA, causal masking, sliding
window, soft-capping, sinks, ALiBi, chunked local attention, bidirectional spans (``attend_end``), FP8 KV caches
with ``kv_scales``.

Why new kernels. :func:`.triton_kernel.paged_attention_kernel` runs every K/V tile through one masked loop (a
position bound, the causal compare and the window on every score, masked gathers on every load), computes its
exponentials in base e, loads K transposed (``[D, N]``: each position's row read across the tile's columns), uses
one tiling (16 or 64 rows) and 2 pipeline stages at 4 warps for every shape, and its split-KV count was a
compile-time constant, so the AOT engine never split (one program per sequence and KV head at batch 1: 8 programs
on 132 SMs for a Llama-3.2-1B decode). On an H100 its prefill was 0.24x transformers' and its decode attention
far from the bandwidth (benchmarks/results/gpu_check_h100_stop33.json).

:func:`flash_prefill_kernel` (grid ``(cdiv(T, BLOCK_Q) + S, Hkv)``): a program owns ``BLOCK_Q`` query tokens of one
sequence times the ``GROUP`` query heads of one KV head (``BLOCK_M`` rows: every K/V tile is loaded once for all
heads that share it), writes its tokens' K/V into the pages, then runs an online softmax (base 2, the scale's
``log2 e`` folded in) over the sequence's positions in four loops, each with only the masks its range needs:

1. whole tiles of the cached prefix (every position older than every query: no causal compare, no bounds, the
   block-table gathers unmasked; only a window's or a chunk's lower bound where the variant has one),
2. the prefix's last partial tile (a position bound),
3. whole tiles of this step's positions before the program's first query (unmasked, read from ``key``/``value``),
4. the diagonal and whatever ``attend_end`` opens past it (causal | span mask and a bound).

Positions of this step are read from the ``key``/``value`` inputs (rounded as the cache stores them), never from
the cache, so no program reads a slot another is writing (the argument of :mod:`.triton_kernel`). Tiles run
heaviest first (a sequence's last query tile sees the most keys; it gets the sequence's first program).

:func:`split_kv_decode_kernel` (grid ``(S, Hkv, num_splits)``, one new token per sequence): a program covers one
slice of one sequence's context for the ``GROUP`` heads of one KV head, reading ``[BLOCK_N, D]`` K/V tiles row by
row (each position's head is ``D`` contiguous elements: 16-byte vector loads), whole tiles unmasked; the new token's
key (this step's) is folded in from the input by the split that ends at it. ``num_splits`` is a launch argument
(:func:`.flash_requests.decode_num_splits`: from the batch and the block table's width, both shapes, so fixed per
captured CUDA graph); each sequence uses ``min(num_splits, cdiv(span, MIN_SPLIT_LEN))`` of them, computed on the
device (:func:`_split_range`), and the programs past those exit at once. With one split the program writes the
output; with more, float32 partials (``m``, ``l`` in base 2, ``acc``) that :func:`split_kv_reduce_kernel` (grid
``(S, H)``) combines (sinks join the denominator there, once). A decode row is its sequence's last position, so
``attend_end`` (keys after the row) opens nothing there: the decode kernels do not read it.

Kernel arguments: input pointers, int32 scalars, output pointers (optional pointers, sinks and attend_end, in
their input position; kernels without them take a constexpr None). The kernels also run on the CPU under
``TRITON_INTERPRET=1`` (``DOT_F32``: float32 dots there, numpy has no bfloat16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmc.plugins.paged_attention.triton_kernel import _as_stored, _find_seq, _fp8_decode, _store_kv

LOG2E = 1.4426950408889634


@triton.jit
def _from_cache(x, FP8: tl.constexpr, NATIVE: tl.constexpr):
    if FP8:
        return _fp8_decode(x, NATIVE)
    else:
        return x


@triton.jit
def _load_cache_tile(cache_ptr, bt_ptr, seq, max_blocks, pos, limit, kvh, offs_d, d_ok,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
                     BOUND: tl.constexpr, D_PADDED: tl.constexpr):
    """``[BLOCK_N, HEAD_PAD]`` of one KV head's cache at logical positions ``pos`` (through the block table), each
    position's ``HEAD_SIZE`` elements contiguous. ``BOUND``: positions ``>= limit`` masked (read as 0)."""
    if BOUND:
        ok = pos < limit
        blk = tl.load(bt_ptr + seq * max_blocks + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + seq * max_blocks + pos // BLOCK_SIZE).to(tl.int64)
    base = ((blk * NUM_KV_HEADS + kvh) * BLOCK_SIZE + pos % BLOCK_SIZE) * HEAD_SIZE
    ptrs = cache_ptr + base[:, None] + offs_d[None, :]
    if BOUND:
        return tl.load(ptrs, mask=ok[:, None] & d_ok[None, :], other=0.0)
    elif D_PADDED:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_new_tile(x_ptr, stride, row0, pos, ctx_old, limit, kvh, offs_d, d_ok, HEAD_SIZE: tl.constexpr,
                   BOUND: tl.constexpr, D_PADDED: tl.constexpr):
    """``[BLOCK_N, HEAD_PAD]`` of this step's ``key``/``value`` rows (``stride`` elements apart) at positions ``pos``
    (row ``row0 + pos - ctx_old``) for one KV head."""
    rows = row0 + (pos - ctx_old)
    ptrs = x_ptr + (rows * stride + kvh * HEAD_SIZE)[:, None] + offs_d[None, :]
    if BOUND:
        return tl.load(ptrs, mask=(pos < limit)[:, None] & d_ok[None, :], other=0.0)
    elif D_PADDED:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _scores(q, k, pos, q_pos, slope, qk_scale, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
            ALIBI: tl.constexpr):
    """Scores of rows ``q [M, D]`` against ``k [N, D]`` in base 2: ``log2(e) * (softcap(q.k * scale) + alibi)``."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if SOFTCAP > 0:
        # softcap * tanh(s / softcap), tanh from exp (saturates to +-1 correctly; tl has no tanh)
        s = SOFTCAP * (1.0 - 2.0 / (tl.exp(s * (2.0 / SOFTCAP)) + 1.0))
    if ALIBI > 0:  # slope * (key position - query position), on logical positions
        s = s + slope[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
    return s * 1.4426950408889634


@triton.jit
def _online(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One online-softmax step (base 2) with scores ``s [M, N]`` (``-inf`` masked) and values ``v [N, D]``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing allowed yet keep m = -inf: subtract 0 there so exp2 sees -inf, never NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_tile(q, k, v, pos, q_pos, q_end, slope, m_i, l_i, acc, qk_scale, limit,
                  CAUSAL: tl.constexpr, BOUND: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                  WINDOW: tl.constexpr, CHUNK: tl.constexpr, ALIBI: tl.constexpr, ATTEND_END: tl.constexpr):
    """A K/V tile (already in the dot type) for the prefill kernel's rows, with the masks its loop needs."""
    s = _scores(q, k, pos, q_pos, slope, qk_scale, PRECISION, SOFTCAP, ALIBI)
    if CAUSAL or BOUND or WINDOW > 0 or CHUNK > 0:
        ok = pos[None, :] >= 0
        if CAUSAL:
            if ATTEND_END:  # bidirectional spans: also the keys ahead of the row, up to attend_end - 1
                ok = (pos[None, :] <= q_pos[:, None]) | (pos[None, :] < q_end[:, None])
            else:
                ok = pos[None, :] <= q_pos[:, None]
        if BOUND:
            ok = ok & (pos < limit)[None, :]
        if WINDOW > 0:
            ok = ok & (pos[None, :] > q_pos[:, None] - WINDOW)
        if CHUNK > 0:  # chunked local attention: the query's own chunk only
            ok = ok & (pos[None, :] >= q_pos[:, None] - q_pos[:, None] % CHUNK)
        s = tl.where(ok, s, float("-inf"))
    return _online(s, v, m_i, l_i, acc, PRECISION)


@triton.jit
def _alibi_slopes(head, NUM_HEADS_POW2: tl.constexpr, ALIBI: tl.constexpr):
    """ALiBi's standard slopes (reference.alibi_slopes): 2^(-ALIBI (h + 1) / n) for the first n heads (n the largest
    power of two <= the head count), the odd-indexed slopes of 2n heads for the rest."""
    hf = head.to(tl.float32)
    e = tl.where(head < NUM_HEADS_POW2, (hf + 1.0) / NUM_HEADS_POW2,
                 (2.0 * (hf - NUM_HEADS_POW2) + 1.0) / (2 * NUM_HEADS_POW2))
    return tl.exp2(-ALIBI * e)


@triton.jit
def _finish(acc, m_i, l_i, v_scale, sink):
    """``acc / l`` (times the V scale), with the sink's ``exp2(sink - m)`` in the denominator (``sink`` -inf: none),
    against ``max(m, sink)`` so neither exponential overflows; rows that saw nothing give 0."""
    top = tl.maximum(m_i, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    a = tl.exp2(m_i - top)
    denom = l_i * a + tl.exp2(sink - top)
    return acc * (v_scale * a / tl.where(denom > 0, denom, 1.0))[:, None]


@triton.jit
def flash_prefill_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, slot_ptr, bt_ptr, ctx_ptr, qsl_ptr, k_cache_ptr, v_cache_ptr, kv_scale_ptr,
    sinks_ptr,  # [NUM_HEADS] logits (read only when HAS_SINKS; else a constexpr None)
    attend_end_ptr,  # [T] int64 (read only when HAS_ATTEND_END; else a constexpr None)
    # int32 scalars (the strides: elements between rows of query, key, value; views of a packed QKV need no copy)
    num_seqs, max_blocks, stride_q, stride_k, stride_v,
    # output (the caches are written in place through their input pointers)
    out_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_Q_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, ALIBI: tl.constexpr, ALIBI_N: tl.constexpr, CHUNK: tl.constexpr,
    HAS_ATTEND_END: tl.constexpr,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    D_PADDED: tl.constexpr = HEAD_PAD != HEAD_SIZE
    tile_id = tl.program_id(0)
    kvh = tl.program_id(1)

    s = _find_seq(qsl_ptr, tile_id, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + s)
    n_new = (tl.load(qsl_ptr + s + 1) - q_start).to(tl.int32)
    tile = (tile_id - (q_start // BLOCK_Q + s)).to(tl.int32)
    n_tiles = tl.cdiv(n_new, BLOCK_Q)
    if tile >= n_tiles:
        return
    tile = n_tiles - 1 - tile  # heaviest first: the sequence's first program takes its last (longest) tile
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

    # ---- this tile's new K/V rows for this KV head, into their slots
    offs_t = tl.arange(0, BLOCK_Q_PAD)
    t_loc = tile * BLOCK_Q + offs_t
    t_ok = (offs_t < BLOCK_Q) & (t_loc < n_new)
    rows = q_start + t_loc
    slot = tl.load(slot_ptr + rows, mask=t_ok, other=-1)
    w_ok = (t_ok & (slot >= 0))[:, None] & d_ok[None, :]
    src = rows[:, None] + 0 * offs_d[None, :]
    col = kvh * HEAD_SIZE + offs_d[None, :]
    dst = (((slot // BLOCK_SIZE) * NUM_KV_HEADS + kvh) * BLOCK_SIZE + slot % BLOCK_SIZE)[:, None] * HEAD_SIZE \
        + offs_d[None, :]
    _store_kv(k_cache_ptr + dst, tl.load(k_ptr + src * stride_k + col, mask=w_ok, other=0.0), k_scale, w_ok, FP8)
    _store_kv(v_cache_ptr + dst, tl.load(v_ptr + src * stride_v + col, mask=w_ok, other=0.0), v_scale, w_ok, FP8)

    # ---- the tile's query rows: BLOCK_Q tokens x GROUP heads (a token's GROUP heads are contiguous in q)
    offs_m = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < n_new)
    q_pos = ctx_old + tok
    q_off = (q_start + tok)[:, None] * stride_q + head[:, None] * HEAD_SIZE + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI > 0:
        slope = _alibi_slopes(head, ALIBI_N, ALIBI)

    first_q = ctx_old + tile * BLOCK_Q
    last_q = tl.minimum(first_q + BLOCK_Q, ctx) - 1
    lo = 0  # the tile's lowest visible position: its first query's window / chunk start
    if WINDOW > 0:
        lo = tl.maximum(first_q - WINDOW + 1, 0)
    if CHUNK > 0:
        lo = tl.maximum(lo, first_q - first_q % CHUNK)
    hi = last_q + 1
    q_end = tl.zeros([BLOCK_M], tl.int32)
    if HAS_ATTEND_END:
        # The rows' spans may reach past the tile's last query (never past the context, which the caller
        # guarantees; the clamp keeps a bad value from reading beyond this step's rows).
        q_end = tl.load(attend_end_ptr + q_start + tok, mask=row_ok, other=0).to(tl.int32)
        hi = tl.minimum(tl.maximum(hi, tl.max(q_end, 0)), ctx)

    qk_scale = SCALE * k_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # 1. whole tiles of the cached prefix (tiles aligned to BLOCK_N; every position < ctx_old <= every q_pos)
    lo_a = lo // BLOCK_N * BLOCK_N
    old_full = tl.maximum(lo_a, ctx_old // BLOCK_N * BLOCK_N)
    for start in range(lo_a, old_full, BLOCK_N):
        pos = start + offs_n
        k = _load_cache_tile(k_cache_ptr, bt_ptr, s, max_blocks, pos, ctx_old, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, False, D_PADDED)
        v = _load_cache_tile(v_cache_ptr, bt_ptr, s, max_blocks, pos, ctx_old, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, False, D_PADDED)
        m_i, l_i, acc = _prefill_tile(q, _from_cache(k, FP8, FP8_NATIVE).to(q.dtype),
                                      _from_cache(v, FP8, FP8_NATIVE).to(q.dtype), pos, q_pos, q_end, slope,
                                      m_i, l_i, acc, qk_scale, ctx_old, False, False, PRECISION, SOFTCAP, WINDOW,
                                      CHUNK, ALIBI, HAS_ATTEND_END)
    # 2. the prefix's last partial tile
    for start in range(old_full, ctx_old, BLOCK_N):
        pos = start + offs_n
        k = _load_cache_tile(k_cache_ptr, bt_ptr, s, max_blocks, pos, ctx_old, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, True, D_PADDED)
        v = _load_cache_tile(v_cache_ptr, bt_ptr, s, max_blocks, pos, ctx_old, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, True, D_PADDED)
        m_i, l_i, acc = _prefill_tile(q, _from_cache(k, FP8, FP8_NATIVE).to(q.dtype),
                                      _from_cache(v, FP8, FP8_NATIVE).to(q.dtype), pos, q_pos, q_end, slope,
                                      m_i, l_i, acc, qk_scale, ctx_old, False, True, PRECISION, SOFTCAP, WINDOW,
                                      CHUNK, ALIBI, HAS_ATTEND_END)
    # 3. whole tiles of this step's positions before the first query (visible to every row), from the inputs
    new_lo = tl.maximum(lo, ctx_old)
    new_full = new_lo + tl.maximum(first_q + 1 - new_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(new_lo, new_full, BLOCK_N):
        pos = start + offs_n
        k = _load_new_tile(k_ptr, stride_k, q_start, pos, ctx_old, hi, kvh, offs_d, d_ok, HEAD_SIZE, False, D_PADDED)
        v = _load_new_tile(v_ptr, stride_v, q_start, pos, ctx_old, hi, kvh, offs_d, d_ok, HEAD_SIZE, False, D_PADDED)
        m_i, l_i, acc = _prefill_tile(q, _as_stored(k, k_scale, k_cache_ptr, FP8, FP8_NATIVE).to(q.dtype),
                                      _as_stored(v, v_scale, v_cache_ptr, FP8, FP8_NATIVE).to(q.dtype), pos, q_pos,
                                      q_end, slope, m_i, l_i, acc, qk_scale, hi, False, False, PRECISION, SOFTCAP,
                                      WINDOW, CHUNK, ALIBI, HAS_ATTEND_END)
    # 4. the diagonal, and the keys attend_end opens past it
    for start in range(new_full, hi, BLOCK_N):
        pos = start + offs_n
        k = _load_new_tile(k_ptr, stride_k, q_start, pos, ctx_old, hi, kvh, offs_d, d_ok, HEAD_SIZE, True, D_PADDED)
        v = _load_new_tile(v_ptr, stride_v, q_start, pos, ctx_old, hi, kvh, offs_d, d_ok, HEAD_SIZE, True, D_PADDED)
        m_i, l_i, acc = _prefill_tile(q, _as_stored(k, k_scale, k_cache_ptr, FP8, FP8_NATIVE).to(q.dtype),
                                      _as_stored(v, v_scale, v_cache_ptr, FP8, FP8_NATIVE).to(q.dtype), pos, q_pos,
                                      q_end, slope, m_i, l_i, acc, qk_scale, hi, True, True, PRECISION, SOFTCAP,
                                      WINDOW, CHUNK, ALIBI, HAS_ATTEND_END)

    sink = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    out = _finish(acc, m_i, l_i, v_scale, sink)
    o_off = ((q_start + tok) * NUM_HEADS + head)[:, None] * HEAD_SIZE + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _split_range(ctx, num_splits, split, WINDOW: tl.constexpr, CHUNK: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The positions ``[lo, hi)`` of split ``split`` of a decode row at position ``ctx - 1`` (empty past the
    sequence's splits): the row's visible span cut into ``min(num_splits, cdiv(span, MIN_SPLIT))`` slices of whole
    ``BLOCK_N`` tiles. The decode and the reduce kernels both call it: the same slices on both sides."""
    q_pos = ctx - 1
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(q_pos - WINDOW + 1, 0)
    if CHUNK > 0:
        lo = tl.maximum(lo, q_pos - q_pos % CHUNK)
    span = ctx - lo
    used = tl.minimum(num_splits, tl.cdiv(span, MIN_SPLIT))
    size = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    s_lo = lo + split * size
    s_hi = tl.minimum(s_lo + size, ctx)
    s_hi = tl.where(split < used, s_hi, s_lo)  # past the sequence's splits: empty
    return s_lo, tl.maximum(s_hi, s_lo)


@triton.jit
def split_kv_decode_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, slot_ptr, bt_ptr, ctx_ptr, qsl_ptr, k_cache_ptr, v_cache_ptr, kv_scale_ptr,
    sinks_ptr,  # [NUM_HEADS] (read only when HAS_SINKS and num_splits == 1: otherwise the reduce adds them)
    # int32 scalars (strides: elements between rows of query, key, value)
    num_seqs, max_blocks, num_splits, stride_q, stride_k, stride_v,
    # outputs: out [T, H*D] when num_splits == 1; else partials m, l [T, H, num_splits], acc [T, H, num_splits, D]
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
    FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
    ALIBI: tl.constexpr, ALIBI_N: tl.constexpr, CHUNK: tl.constexpr,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    D_PADDED: tl.constexpr = HEAD_PAD != HEAD_SIZE
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if s >= num_seqs:
        return
    t = tl.load(qsl_ptr + s)  # the sequence's one new row (every decode chunk has exactly one)
    if tl.load(qsl_ptr + s + 1) == t:
        return
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    ctx_old = ctx - 1
    s_lo, s_hi = _split_range(ctx, num_splits, split, WINDOW, CHUNK, MIN_SPLIT, BLOCK_N)
    if FP8:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    else:
        k_scale = 1.0
        v_scale = 1.0
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    k_src = t * stride_k + kvh * HEAD_SIZE + offs_d
    v_src = t * stride_v + kvh * HEAD_SIZE + offs_d
    if split == 0:  # the new row's K/V for this KV head, into its slot
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            dst = (((slot // BLOCK_SIZE) * NUM_KV_HEADS + kvh) * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_SIZE + offs_d
            _store_kv(k_cache_ptr + dst, tl.load(k_ptr + k_src, mask=d_ok, other=0.0), k_scale, d_ok, FP8)
            _store_kv(v_cache_ptr + dst, tl.load(v_ptr + v_src, mask=d_ok, other=0.0), v_scale, d_ok, FP8)
    if s_lo >= s_hi:
        return  # a split past this sequence's (a short context in a launch sized for long ones)

    offs_h = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + offs_h
    h_ok = offs_h < GROUP
    q = tl.load(q_ptr + t * stride_q + head[:, None] * HEAD_SIZE + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    slope = tl.zeros([BLOCK_H], tl.float32)
    if ALIBI > 0:
        slope = _alibi_slopes(head, ALIBI_N, ALIBI)
    q_pos = tl.zeros([BLOCK_H], tl.int32) + ctx_old
    qk_scale = SCALE * k_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # The cached positions of the split: every one visible (the split starts at or after the row's window/chunk
    # start), so whole tiles need no mask at all, the last partial tile a bound.
    c_hi = tl.minimum(s_hi, ctx_old)
    c_full = s_lo + tl.maximum(c_hi - s_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(s_lo, c_full, BLOCK_N):
        pos = start + offs_n
        k = _load_cache_tile(k_cache_ptr, bt_ptr, s, max_blocks, pos, c_hi, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, False, D_PADDED)
        v = _load_cache_tile(v_cache_ptr, bt_ptr, s, max_blocks, pos, c_hi, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, False, D_PADDED)
        sc = _scores(q, _from_cache(k, FP8, FP8_NATIVE), pos, q_pos, slope, qk_scale, PRECISION, SOFTCAP, ALIBI)
        m_i, l_i, acc = _online(sc, _from_cache(v, FP8, FP8_NATIVE).to(q.dtype), m_i, l_i, acc, PRECISION)
    for start in range(c_full, c_hi, BLOCK_N):
        pos = start + offs_n
        k = _load_cache_tile(k_cache_ptr, bt_ptr, s, max_blocks, pos, c_hi, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, True, D_PADDED)
        v = _load_cache_tile(v_cache_ptr, bt_ptr, s, max_blocks, pos, c_hi, kvh, offs_d, d_ok, NUM_KV_HEADS,
                             BLOCK_SIZE, HEAD_SIZE, True, D_PADDED)
        sc = _scores(q, _from_cache(k, FP8, FP8_NATIVE), pos, q_pos, slope, qk_scale, PRECISION, SOFTCAP, ALIBI)
        sc = tl.where((pos < c_hi)[None, :], sc, float("-inf"))
        m_i, l_i, acc = _online(sc, _from_cache(v, FP8, FP8_NATIVE).to(q.dtype), m_i, l_i, acc, PRECISION)
    if s_hi == ctx:
        # The row's own key and value (this step's: from the inputs, rounded as the cache stores them): one column,
        # a product and a sum per head rather than a 16-wide dot. ALiBi's bias is 0 at the row's own position.
        k_new = _as_stored(tl.load(k_ptr + k_src, mask=d_ok, other=0.0), k_scale, k_cache_ptr, FP8, FP8_NATIVE)
        v_new = _as_stored(tl.load(v_ptr + v_src, mask=d_ok, other=0.0), v_scale, v_cache_ptr, FP8, FP8_NATIVE)
        sn = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        if SOFTCAP > 0:
            sn = SOFTCAP * (1.0 - 2.0 / (tl.exp(sn * (2.0 / SOFTCAP)) + 1.0))
        sn = sn * 1.4426950408889634
        m_new = tl.maximum(m_i, sn)
        alpha = tl.exp2(m_i - m_new)  # m_new is finite: the row sees its own key
        p = tl.exp2(sn - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m_i = m_new

    row = t.to(tl.int64) * NUM_HEADS + head  # (token, head)
    if num_splits == 1:
        sink = tl.full([BLOCK_H], float("-inf"), tl.float32)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        out = _finish(acc, m_i, l_i, v_scale, sink)
        tl.store(out_ptr + row[:, None] * HEAD_SIZE + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])
    else:
        tl.store(part_m_ptr + row * num_splits + split, m_i, mask=h_ok)
        tl.store(part_l_ptr + row * num_splits + split, l_i, mask=h_ok)
        tl.store(part_acc_ptr + (row * num_splits + split)[:, None] * HEAD_SIZE + offs_d[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def split_kv_reduce_kernel(
    ctx_ptr, qsl_ptr, kv_scale_ptr, sinks_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    num_seqs, num_splits,
    out_ptr,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, WINDOW: tl.constexpr,
    CHUNK: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    SPLITS_PAD: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out[t, h] = sum_i 2^(m_i - M) acc_i / (sum_i 2^(m_i - M) l_i [+ 2^(sink - M)]) over the sequence's non-empty
    splits (the same :func:`_split_range` as the decode kernel: no flag written by the empty ones)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    if s >= num_seqs:
        return
    t = tl.load(qsl_ptr + s)
    if tl.load(qsl_ptr + s + 1) == t:
        return
    ctx = tl.load(ctx_ptr + s).to(tl.int32)
    row = t.to(tl.int64) * NUM_HEADS + h
    offs_s = tl.arange(0, SPLITS_PAD)
    lo_s, hi_s = _split_range(ctx, num_splits, offs_s, WINDOW, CHUNK, MIN_SPLIT, BLOCK_N)
    ok = (offs_s < num_splits) & (hi_s > lo_s)
    m = tl.load(part_m_ptr + row * num_splits + offs_s, mask=ok, other=float("-inf"))
    lsum = tl.load(part_l_ptr + row * num_splits + offs_s, mask=ok, other=0.0)
    m_max = tl.max(m, 0)  # finite: a non-empty split saw at least one visible key
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.where(ok, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(lsum * w, 0) + tl.exp2(sink - m_max)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    acc = tl.zeros([HEAD_PAD], tl.float32)
    offs_b = tl.arange(0, BLOCK_S)
    for first in range(0, num_splits, BLOCK_S):  # the [splits, D] partials a few splits at a time (registers)
        i = first + offs_b
        lo_i, hi_i = _split_range(ctx, num_splits, i, WINDOW, CHUNK, MIN_SPLIT, BLOCK_N)
        ok_i = (i < num_splits) & (hi_i > lo_i)
        m_i = tl.load(part_m_ptr + row * num_splits + i, mask=ok_i, other=float("-inf"))
        w_i = tl.where(ok_i, tl.exp2(m_i - m_max), 0.0)
        a = tl.load(part_acc_ptr + (row * num_splits + i)[:, None] * HEAD_SIZE + offs_d[None, :],
                    mask=ok_i[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(a * w_i[:, None], 0)
    out = acc / denom
    if FP8:
        out = out * tl.load(kv_scale_ptr + 1)
    tl.store(out_ptr + row * HEAD_SIZE + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


__all__ = ["LOG2E", "flash_prefill_kernel", "split_kv_decode_kernel", "split_kv_reduce_kernel"]
