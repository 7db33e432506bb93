"""ALiBi (bloom, mpt) in every PagedAttention implementation, against the numpy reference.

ALiBi adds ``slope_h * (k_pos - q_pos)`` to head ``h``'s scores: the standard slopes (``2^(-8 (h + 1) / n)`` for
the first ``n`` heads, ``n`` the largest power of two <= the head count, then the odd-indexed slopes of ``2n``
heads), on the sequence's logical positions (never cache slots), after the 1/sqrt(d) scale (the bias is not
scaled). The op carries it as the attribute ``alibi_max_bias`` (8: the paper's, and bloom's and mpt's default).
The slopes are first held to transformers' own (bloom ``build_alibi_tensor``, mpt ``build_mpt_alibi_tensor``,
head counts that are and are not powers of two), and the reference to bloom's attention (scores + slope * k_pos,
softmax in float32); then each implementation is held to the reference on fresh random inputs: the C++ CPU
kernel (every ISA; tiled and per-row loops; split contexts; float16 caches), the native ONNX Runtime ops
(``PagedAttention``, ``RotaryPagedAttention``), the Python ORT op, the torch custom op the frontend traces, the
CUDA engine's torch attention, and the Triton kernel (interpreted; one launch and split-KV). Steps mix prefill
chunks and decodes over scattered block tables, so a slot-based bias would differ. Tolerances as in
test_attention_sinks.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does it too)

from llmc.plugins.paged_attention import reference  # noqa: E402
from llmc.plugins.paged_attention.cpu import load_kernel  # noqa: E402
from llmc.testing import attention_variants as av  # noqa: E402
from llmc.testing.attention_variants import ATOL, RTOL, run_reference  # noqa: E402
from llmc.testing.paged_attention import make_case  # noqa: E402

MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12)]  # decode / whole prefill / chunks

kernel = load_kernel()


def case(seed, *, hq=12, hkv=4, d=64, bs=16, seqs=MIXED, window=0, max_bias=8.0, **kw):
    # 12 query heads (not a power of two): heads 8..11 take the odd-indexed slopes of 16 heads.
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, **kw)
    return inputs, caches, {**attrs, "sliding_window": window, "alibi_max_bias": max_bias}



# -------------------------------------------------------------------------------------------
# The definition


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40, 71])
def test_slopes_are_transformers(num_heads):
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    got = reference.alibi_slopes(num_heads)
    bloom = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1].numpy()
    mpt = build_mpt_alibi_tensor(num_heads, 2)  # slope * (j - 1): column 1 minus column 0
    mpt = (mpt[:, 0, 1] - mpt[:, 0, 0]).numpy()
    np.testing.assert_allclose(got, bloom, rtol=2e-5, atol=0)  # bloom rounds base**k in float32
    np.testing.assert_allclose(got, mpt, rtol=1e-6, atol=0)
    from llmc.runtime.workers.cuda.ops import alibi_slopes

    np.testing.assert_array_equal(alibi_slopes(num_heads, 8.0).numpy(), got)


def test_reference_is_bloom_attention():
    """One sequence with cached positions and new rows: the reference equals bloom's attention (the
    ``slope * k_pos`` bias of ``build_alibi_tensor`` added to the scaled scores, causal mask, float32 softmax),
    and differs from attention without the bias."""
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    hq, hkv, d, bs, ctx, n_new = 6, 6, 32, 8, 45, 13
    inputs, caches, attrs = case(7, hq=hq, hkv=hkv, d=d, bs=bs, seqs=[(ctx, n_new)])
    got, (k_cache, v_cache) = run_reference(inputs, caches, attrs)
    blocks = inputs["block_tables"][0, : -(-ctx // bs)]
    k = k_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    v = v_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    q = inputs["query"].reshape(n_new, hq, d).transpose(1, 0, 2)
    alibi = build_alibi_tensor(torch.ones(1, ctx), hq, torch.float32)  # [H, 1, ctx]
    scores = torch.baddbmm(alibi, torch.from_numpy(q), torch.from_numpy(k).transpose(1, 2), beta=1.0,
                           alpha=attrs["scale"])
    qpos, kpos = np.arange(ctx - n_new, ctx)[:, None], np.arange(ctx)[None, :]
    scores = scores.masked_fill(torch.from_numpy(kpos > qpos)[None], float("-inf"))
    want = torch.bmm(torch.softmax(scores, -1), torch.from_numpy(v)).transpose(0, 1).reshape(n_new, hq * d)
    np.testing.assert_allclose(got, want.numpy(), rtol=RTOL, atol=ATOL)
    plain, _ = run_reference(inputs, caches, {**attrs, "alibi_max_bias": 0.0})
    assert np.abs(plain - got).max() > 1e-2  # the bias matters in this case


# -------------------------------------------------------------------------------------------
# The C++ CPU kernel


@pytest.fixture(params=av.ISAS)
def isa(request):
    try:
        kernel._set_isa(request.param)
    except ValueError as exc:
        pytest.skip(str(exc))
    yield kernel.get_isa()
    kernel._set_isa("auto")


CPU_CASES = {
    "tiled_mixed": dict(),
    "tiled_window": dict(window=16),
    "per_row": dict(d=36, bs=12, pad_rows=2),
    "split_context": dict(seqs=[(2000, 1), (1337, 2)], q_scale=2.0, max_bias=4.0),
    "per_row_split": dict(d=20, bs=5, seqs=[(900, 1), (40, 40)]),
    "float16_cache": dict(cache_dtype=np.float16),
    "mha_pow2": dict(hq=8, hkv=8, d=16, bs=8),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel(isa, name):
    inputs, caches, attrs = case(abs(hash(name)) % 2**32, **CPU_CASES[name])
    av.check_cpu_kernel(inputs, caches, attrs, atol=1e-4 if "split" in name else ATOL)


# -------------------------------------------------------------------------------------------
# ONNX Runtime: the native ops and the Python op


def _node_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ("scale", "sliding_window", "alibi_max_bias")}


@pytest.mark.parametrize("window", [0, 16])
def test_native_ort_op(window):
    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(30 + window, hq=hq, hkv=hkv, d=d, bs=8, window=window, pad_rows=1)
    av.check_native_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)


def test_native_rotary_ort_op():
    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(41, hq=hq, hkv=hkv, d=d, bs=8, seqs=[(40, 40), (75, 1), (19, 7)])
    av.check_native_rotary_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)


def test_python_ort_op():
    from llmc.plugins.paged_attention import OP_TYPE, PYOP_EXTENDED

    hq, hkv, d = 6, 2, 16
    inputs, caches, attrs = case(51, hq=hq, hkv=hkv, d=d, bs=8, window=16)
    # The Python op of ALiBi nodes declares every optional attribute (the backend lowering fills in the absent).
    av.check_python_op(OP_TYPE + PYOP_EXTENDED, inputs, caches, attrs,
                       {**_node_attrs(attrs), "softcap": 0.0, "attention_chunk": 0}, hq, hkv, d)


# -------------------------------------------------------------------------------------------
# torch: the traced op and the CUDA engine's attention


def test_torch_custom_op_and_cuda_engine_attention():
    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(61, hq=hq, hkv=hkv, d=d, bs=8, window=16, pad_rows=1)
    av.check_torch_ops(inputs, caches, attrs, hq, hkv, d, custom_op_tail=(16, 0.0, None, 8.0),
                       torch_kwargs=dict(sliding_window=16, alibi_max_bias=8.0))


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,window", [(1, 0), (1, 16), (4, 0), (2, 16)])
def test_triton_kernel(num_splits, window):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(150, 1), (37, 37), (90, 12), (1, 1)] if num_splits == 1 else [(300, 1), (129, 1), (64, 2)]
    inputs, caches, attrs = case(71 + num_splits + window, hq=12, hkv=4, d=32, bs=16, seqs=seqs, window=window)
    av.check_triton(inputs, caches, attrs, num_splits)
