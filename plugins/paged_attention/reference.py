"""Reference PagedAttention in numpy: slow, obviously correct, the definition every kernel is tested against."""

from __future__ import annotations

import numpy as np


def write_kv(
    key: np.ndarray,
    value: np.ndarray,
    slot_mapping: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
) -> None:
    """Store new tokens' K/V ``[T, Hkv*D]`` into caches ``[blocks, Hkv, block_size, D]`` in place."""
    _, hkv, block_size, d = k_cache.shape
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding rows carry no K/V
            continue
        b, off = divmod(slot, block_size)
        k_cache[b, :, off, :] = key[t].reshape(hkv, d)
        v_cache[b, :, off, :] = value[t].reshape(hkv, d)


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al.), float32 ``[num_heads]``: with ``n`` the largest power of two
    ``<= num_heads``, head ``h < n`` has slope ``2^(-max_bias (h + 1) / n)``; the other heads take the odd-indexed
    slopes of ``2n`` heads, ``2^(-max_bias (2j + 1) / 2n)`` (transformers' bloom ``build_alibi_tensor``, and mpt's
    ``build_mpt_alibi_tensor`` with ``alibi_bias_max = max_bias``)."""
    n = 1 << (int(num_heads).bit_length() - 1)
    h = np.arange(num_heads, dtype=np.float64)
    e = np.where(h < n, (h + 1) / n, (2 * (h - n) + 1) / (2 * n))
    return np.exp2(-float(max_bias) * e).astype(np.float32)


def first_visible(pos: np.ndarray, sliding_window: int = 0, attention_chunk: int = 0) -> np.ndarray:
    """The first key position a query at ``pos`` sees: 0, raised by a sliding window (its last
    ``sliding_window`` positions) and by chunked local attention (its own chunk, ``floor(pos / C) * C``)."""
    lo = np.zeros_like(pos)
    if sliding_window > 0:
        lo = np.maximum(lo, pos - sliding_window + 1)
    if attention_chunk > 0:
        lo = np.maximum(lo, pos - pos % attention_chunk)
    return lo


def paged_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    slot_mapping: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start_loc: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: np.ndarray | None = None,
    alibi_max_bias: float = 0.0,
    attention_chunk: int = 0,
    attend_end: np.ndarray | None = None,
) -> np.ndarray:
    """Write the new K/V into the caches, then attend. Returns ``[T, num_heads * head_size]``.

    ``sliding_window`` > 0 limits each query to its last ``sliding_window`` positions;
    ``softcap`` > 0 applies ``softcap * tanh(scores / softcap)`` before the softmax.
    ``sinks`` ``[num_heads]`` (attention sinks, gpt-oss): one logit per query head that joins every
    softmax denominator of that head and adds nothing to the value sum,
    ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``, in float32 (transformers' gpt_oss
    ``eager_attention_forward``: the sink is a last column of the logits, dropped after the softmax).
    ``alibi_max_bias`` > 0 (ALiBi: bloom, mpt): head ``h``'s scores gain ``slope_h * (k_pos - q_pos)`` with the
    slopes of :func:`alibi_slopes`, on the sequence's logical positions (never cache slots), after the scale and
    any soft-cap, in float32 (transformers adds ``slope_h * k_pos``; the row's constant cancels in the softmax).
    ``attention_chunk`` = C > 0 (chunked local attention, llama4): a query at position ``p`` sees the keys
    ``[floor(p / C) * C, p]`` (absolute chunks, not a window).
    ``attend_end`` ``[T]`` int64 (bidirectional spans, Gemma 3's image tokens): row ``t`` at position ``q`` also
    sees the keys ``q < k < attend_end[t]`` of its sequence, on top of the causal rule; the lower bound (sliding
    window, chunk) still applies, so with a window the visible set is ``k > q - window AND (k <= q OR
    k < attend_end[t])``, transformers' ``AND(sliding_window, OR(causal, blockwise))``. ``attend_end[t] <= q + 1``
    is plain causal attention. Every key it names must be in the cache after this step's writes
    (``attend_end[t] <= context_lens[s]``, else ValueError): the op writes the whole step's K/V before attending.
    """
    write_kv(key, value, slot_mapping, k_cache, v_cache)
    _, hkv, block_size, d = k_cache.shape
    assert hkv == num_kv_heads
    group = num_heads // num_kv_heads
    if sinks is not None:
        sinks = np.asarray(sinks, dtype=np.float32).reshape(-1)
        assert sinks.shape == (num_heads,), f"sinks must have one logit per query head ({num_heads}), got {sinks.shape}"
    slopes = alibi_slopes(num_heads, alibi_max_bias) if alibi_max_bias > 0 else None
    if attend_end is not None:
        attend_end = np.asarray(attend_end).reshape(-1)
        if attend_end.shape != (query.shape[0],):
            raise ValueError(f"attend_end must have one entry per row of query ({query.shape[0]}), got "
                             f"{attend_end.shape}")
    out = np.zeros((query.shape[0], num_heads * d), dtype=query.dtype)
    for s in range(len(context_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n_new, ctx = end - start, int(context_lens[s])
        if n_new == 0:
            continue
        if attend_end is not None and attend_end[start:end].max() > ctx:
            raise ValueError(f"sequence {s}: attend_end reaches position {int(attend_end[start:end].max()) - 1} but "
                             f"the cache holds {ctx} positions after this step (context_lens)")
        n_blocks = -(-ctx // block_size)
        blocks = block_tables[s, :n_blocks]
        # [Hkv, ctx, D] gathered from the sequence's blocks
        k = k_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].astype(np.float32)
        v = v_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].astype(np.float32)
        q = query[start:end].reshape(n_new, num_heads, d).astype(np.float32)
        for h in range(num_heads):
            kh, vh = k[h // group], v[h // group]
            scores = (q[:, h, :] @ kh.T) * scale  # [n_new, ctx]
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            pos_q = np.arange(ctx - n_new, ctx)[:, None]
            pos_k = np.arange(ctx)[None, :]
            if slopes is not None:
                scores = scores + slopes[h] * (pos_k - pos_q).astype(np.float32)
            causal = pos_k <= pos_q
            if attend_end is not None:
                causal = causal | (pos_k < attend_end[start:end, None])
            allowed = causal & (pos_k >= first_visible(pos_q, sliding_window, attention_chunk))
            scores = np.where(allowed, scores, -np.inf)
            top = scores.max(axis=-1, keepdims=True)
            if sinks is not None:
                top = np.maximum(top, sinks[h])
            scores -= top
            p = np.exp(scores)
            denom = p.sum(axis=-1, keepdims=True)
            if sinks is not None:
                denom = denom + np.exp(sinks[h] - top)
            p /= denom
            out[start:end, h * d : (h + 1) * d] = (p @ vh).astype(query.dtype)
    return out


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, num_heads: int) -> np.ndarray:
    """Rotary embedding, rotate-half (GPT-NeoX) form, as ONNX ``RotaryEmbedding`` with interleaved=0.

    ``x`` ``[T, num_heads * D]``; ``cos``/``sin`` ``[T, D/2]`` (the angles of each row's position).
    """
    t = x.shape[0]
    h = x.reshape(t, num_heads, -1).astype(np.float32)
    half = h.shape[-1] // 2
    c, s = cos[:, None, :].astype(np.float32), sin[:, None, :].astype(np.float32)
    a, b = h[..., :half], h[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1).reshape(t, -1)


def rotary_paged_attention(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, slot_mapping: np.ndarray,
                           block_tables: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray,
                           k_cache: np.ndarray, v_cache: np.ndarray, *, num_heads: int, num_kv_heads: int,
                           scale: float, sliding_window: int = 0, softcap: float = 0.0,
                           sinks: np.ndarray | None = None, alibi_max_bias: float = 0.0,
                           attention_chunk: int = 0, attend_end: np.ndarray | None = None) -> np.ndarray:
    """``RotaryPagedAttention``: split ``qkv [..., T, (H + 2*Hkv) * D]`` into Q, K, V; rotate Q and K by
    ``cos``/``sin`` ``[..., T, D/2]``; then :func:`paged_attention`. Returns ``[T, H * D]``."""
    d = k_cache.shape[-1]
    x = qkv.reshape(-1, qkv.shape[-1])
    c, s = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    q, k, v = np.split(x, [num_heads * d, (num_heads + num_kv_heads) * d], axis=-1)
    return paged_attention(rotate_half(q, c, s, num_heads), rotate_half(k, c, s, num_kv_heads), v, slot_mapping,
                           block_tables, context_lens, query_start_loc, k_cache, v_cache, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, scale=scale, sliding_window=sliding_window, softcap=softcap,
                           sinks=sinks, alibi_max_bias=alibi_max_bias, attention_chunk=attention_chunk,
                           attend_end=attend_end)
