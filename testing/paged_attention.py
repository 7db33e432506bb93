"""Random PagedAttention steps for differential tests (the Triton kernel's tests and scripts/gpu_check.py)."""

from __future__ import annotations

import math

import numpy as np


def make_case(rng, *, hq, hkv, d, bs, seqs, spare_blocks=3, pad_rows=0, q_scale=1.0, cache_dtype=np.float32):
    """float32 numpy inputs for sequences given as (context length after this step, new tokens).

    Shared by the kernel tests: non-contiguous, unordered block ids; unused
    block-table columns -1; this step's slots hold garbage before the call; ``pad_rows`` trailing
    rows belong to no sequence (slot -1).
    """
    nblocks = [-(-ctx // bs) for ctx, _ in seqs]
    num_blocks = sum(nblocks) + spare_blocks
    perm = rng.permutation(num_blocks)
    block_tables = np.full((len(seqs), max(nblocks) + 2), -1, dtype=np.int64)
    used = 0
    for s, nb in enumerate(nblocks):
        block_tables[s, :nb] = perm[used : used + nb]
        used += nb
    slots, qsl = [], [0]
    for s, (ctx, n_new) in enumerate(seqs):
        slots += [block_tables[s, p // bs] * bs + p % bs for p in range(ctx - n_new, ctx)]
        qsl.append(qsl[-1] + n_new)
    slots += [-1] * pad_rows
    t = len(slots)
    inputs = dict(
        query=(q_scale * rng.standard_normal((t, hq * d))).astype(np.float32),
        key=rng.standard_normal((t, hkv * d)).astype(np.float32),
        value=rng.standard_normal((t, hkv * d)).astype(np.float32),
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=block_tables,
        context_lens=np.array([ctx for ctx, _ in seqs], dtype=np.int64),
        query_start_loc=np.array(qsl, dtype=np.int64),
    )
    shape = (num_blocks, hkv, bs, d)
    caches = rng.standard_normal(shape).astype(cache_dtype), rng.standard_normal(shape).astype(cache_dtype)
    return inputs, caches, dict(num_heads=hq, num_kv_heads=hkv, scale=1.0 / math.sqrt(d))


def check_case(inputs, caches, attrs, *, atol: dict, act="fp32", cache="fp32", seed=None, fp8_scales=None,
               device="cpu", kernel=None, **kernel_kw):
    """Run the numpy reference and the Triton kernel on the same (rounded) values; raise AssertionError
    unless the slots of this step hold what the reference wrote (FP8: the E4M3 codes of ``x / scale``),
    no other cache byte changed, and the outputs agree within ``atol[act]``. Returns (kernel, reference)
    outputs as float32 numpy arrays. CPU tensors run under the Triton interpreter. ``kernel``: the implementation
    (``triton_kernel.paged_attention``'s arguments and result; that function by default)."""
    import torch

    from llmc.plugins.paged_attention import reference
    from llmc.plugins.paged_attention import triton_kernel as tk
    from llmc.quant.minifloat import E4M3

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    info = f"seed={seed} act={act} cache={cache} {kernel_kw}"
    tin = {k: torch.from_numpy(v) for k, v in inputs.items()}
    for name in ("query", "key", "value"):
        tin[name] = tin[name].to(dtypes[act])
    k0, v0 = (torch.from_numpy(c) for c in caches)
    ref_in = {k: (v.float().numpy() if v.is_floating_point() else v.numpy()) for k, v in tin.items()}
    rounded = dict(ref_in)  # the K/V values the kernel receives (before any FP8 round trip)
    if fp8_scales is not None:
        # FP8: the caches hold E4M3 codes; the reference sees their values, and new K/V after the Q/DQ
        # round trip the CPU graph applies (passes/quantize.py: QuantizeLinear/DequantizeLinear, saturating).
        ks, vs = fp8_scales
        codes = [torch.from_numpy(E4M3.encode(c.numpy() * 0.5)) for c in (k0, v0)]  # any valid codes
        k_ker, v_ker = codes[0].clone(), codes[1].clone()
        k_ref = E4M3.decode(codes[0].numpy()) * ks
        v_ref = E4M3.decode(codes[1].numpy()) * vs
        for name, sc in (("key", ks), ("value", vs)):
            ref_in[name] = E4M3.decode(E4M3.encode(ref_in[name] / np.float32(sc))) * np.float32(sc)
        kernel_kw["kv_scales"] = torch.tensor([ks, vs], dtype=torch.float32)
    else:
        k_ker, v_ker = k0.to(dtypes[cache]), v0.to(dtypes[cache])
        # float16 caches stay float16 in the reference (it rounds written rows as the kernel must);
        # bfloat16 ones hold bfloat16 values in float32 (numpy has no bfloat16; rows written are bf16 already).
        np_cache = np.float16 if cache == "fp16" else np.float32
        k_ref, v_ref = k_ker.float().numpy().astype(np_cache), v_ker.float().numpy().astype(np_cache)
    k_before, v_before = k_ker.clone(), v_ker.clone()

    expected = reference.paged_attention(**ref_in, k_cache=k_ref, v_cache=v_ref, **attrs)
    if attrs.get("sinks") is not None:  # attention sinks: numpy for the reference, a tensor for the kernel
        attrs = {**attrs, "sinks": torch.from_numpy(np.asarray(attrs["sinks"], dtype=np.float32)).to(device)}
    on_dev = {k: v.to(device) for k, v in tin.items()}
    k_dev, v_dev = k_ker.to(device), v_ker.to(device)
    if "kv_scales" in kernel_kw:
        kernel_kw["kv_scales"] = kernel_kw["kv_scales"].to(device)
    got = (kernel or tk.paged_attention)(**on_dev, k_cache=k_dev, v_cache=v_dev, **attrs, **kernel_kw).cpu()
    k_ker, v_ker = k_dev.cpu(), v_dev.cpu()

    assert got.dtype == dtypes[act] and tuple(got.shape) == expected.shape, info
    written = torch.zeros(k_ker.shape[0] * k_ker.shape[2], dtype=torch.bool)
    slots = inputs["slot_mapping"]
    written[torch.from_numpy(slots[slots >= 0])] = True
    written = written.reshape(k_ker.shape[0], 1, k_ker.shape[2], 1).expand(k_ker.shape)
    for name, ker, ref, before in (("k_cache", k_ker, k_ref, k_before), ("v_cache", v_ker, v_ref, v_before)):
        assert torch.equal(ker[~written], before[~written]), f"{name}: a slot outside slot_mapping changed; {info}"
        if fp8_scales is not None:
            sc = fp8_scales[0] if name == "k_cache" else fp8_scales[1]
            want = E4M3.encode(rounded["key" if name == "k_cache" else "value"] / np.float32(sc))
            new = ker.numpy()[written.numpy()]
            expect_codes = _codes_at_slots(want, slots, ker.shape)
            np.testing.assert_array_equal(new, expect_codes, err_msg=f"{name} FP8 codes; {info}")
        else:
            np.testing.assert_array_equal(ker.float().numpy()[written.numpy()], ref.astype(np.float32)[written.numpy()],
                                          err_msg=f"{name} new rows; {info}")
    got_np = got.float().numpy()
    assert np.isfinite(got_np).all(), info
    np.testing.assert_allclose(got_np, expected.astype(np.float32), rtol=0, atol=atol[act], err_msg=info)
    return got_np, expected


def _codes_at_slots(codes_tokens, slots, cache_shape):
    """The cache after writing ``codes_tokens [T, Hkv*D]`` into ``slots``, read back at the written positions."""
    nb, hkv, bs, d = cache_shape
    cache = np.zeros(cache_shape, dtype=np.uint8)
    mask = np.zeros(cache_shape, dtype=bool)
    for t, slot in enumerate(slots):
        if slot >= 0:
            cache[slot // bs, :, slot % bs, :] = codes_tokens[t].reshape(hkv, d)
            mask[slot // bs, :, slot % bs, :] = True
    return cache[mask]


def flash_attention(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, k_cache, v_cache, *,
                    num_heads: int, num_kv_heads: int, scale: float, sliding_window: int = 0, softcap: float = 0.0,
                    kv_scales=None, sinks=None, alibi_max_bias: float = 0.0, attention_chunk: int = 0,
                    attend_end=None, num_splits: int | None = None, prefill=None, decode=None, num_sms: int = 132,
                    min_split: int | None = None, record: dict | None = None):
    """The flash kernels (llmc.plugins.paged_attention.flash) through the CUDA session's launch sequence
    (``flash_requests.run_attention``), under the Triton interpreter on CPU tensors: ``check_case(kernel=...)``'s
    implementation. ``prefill``/``decode``: :class:`~llmc.plugins.paged_attention.flash_requests.Tiling` other than
    the GPU's (small tiles keep the interpreter fast); ``min_split``: the least positions of a decode split (many
    splits over short contexts); ``record``: filled with the kernels (their ``launches``)."""
    import torch

    from llmc.plugins.paged_attention import flash_requests as fr

    tl_name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8"}
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=k_cache.shape[-1], scale=scale,
                 sliding_window=sliding_window, softcap=softcap, alibi_max_bias=alibi_max_bias,
                 attention_chunk=attention_chunk, has_sinks=int(sinks is not None),
                 has_attend_end=int(attend_end is not None))
    kernels = fr.jit_kernels(attrs, act=tl_name[query.dtype], cache=tl_name[k_cache.dtype],
                             block_size=k_cache.shape[2], interpret=query.device.type == "cpu", prefill=prefill,
                             decode=decode, **({"min_split": min_split} if min_split else {}))
    if record is not None:
        record["kernels"] = kernels
    scales = (torch.ones(2, dtype=torch.float32, device=query.device) if kv_scales is None
              else torch.as_tensor(kv_scales, dtype=torch.float32, device=query.device).reshape(2))
    if sinks is not None:
        sinks = sinks.reshape(-1).float().contiguous()
    if attend_end is not None:
        attend_end = attend_end.reshape(-1).to(torch.int64).contiguous()
    meta = [t.to(torch.int64).contiguous() for t in (slot_mapping, block_tables, context_lens, query_start_loc)]
    out = torch.zeros((query.shape[0], num_heads * k_cache.shape[-1]), dtype=query.dtype, device=query.device)
    return fr.run_attention(kernels, query.contiguous(), key.contiguous(), value.contiguous(), *meta, k_cache,
                            v_cache, scales, sinks=sinks, attend_end=attend_end, num_sms=num_sms,
                            num_splits=num_splits, out=out)
