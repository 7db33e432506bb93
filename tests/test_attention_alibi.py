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

from onnx import TensorProto, helper  # noqa: E402

from llmc.plugins.paged_attention import INPUT_NAMES, ort_native, reference  # noqa: E402
from llmc.plugins.paged_attention.cpu import load_kernel, paged_attention_cpu  # noqa: E402
from llmc.testing.ort_sessions import native_session  # noqa: E402
from llmc.testing.paged_attention import make_case  # noqa: E402

RTOL, ATOL = 1e-4, 2e-5
MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12)]  # decode / whole prefill / chunks

kernel = load_kernel()


def case(seed, *, hq=12, hkv=4, d=64, bs=16, seqs=MIXED, window=0, max_bias=8.0, **kw):
    # 12 query heads (not a power of two): heads 8..11 take the odd-indexed slopes of 16 heads.
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, **kw)
    return inputs, caches, {**attrs, "sliding_window": window, "alibi_max_bias": max_bias}


def run_reference(inputs, caches, attrs):
    k, v = (c.copy() for c in caches)
    return reference.paged_attention(**inputs, k_cache=k, v_cache=v, **attrs), (k, v)


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
    from llmc.runtime.torch_ops import alibi_slopes

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


@pytest.fixture(params=["avx512", "avx2", "baseline"])
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
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    k, v = (c.copy() for c in caches)
    got = paged_attention_cpu(**inputs, k_cache=k, v_cache=v, **attrs)
    np.testing.assert_array_equal(k, k_ref)
    np.testing.assert_array_equal(v, v_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=1e-4 if "split" in name else ATOL)


# -------------------------------------------------------------------------------------------
# ONNX Runtime: the native ops and the Python op


def _graph(op: str, hq: int, hkv: int, d: int, attrs: dict, domain: str = "llmc") -> bytes:
    f = TensorProto.FLOAT
    if op == "RotaryPagedAttention":
        heads = ["qkv", "cos", "sin"]
        inputs = [helper.make_tensor_value_info("qkv", f, ["T", (hq + 2 * hkv) * d]),
                  helper.make_tensor_value_info("cos", f, ["T", d // 2]),
                  helper.make_tensor_value_info("sin", f, ["T", d // 2])]
    else:
        heads = list(INPUT_NAMES[:3])
        inputs = [helper.make_tensor_value_info("query", f, ["T", hq * d]),
                  helper.make_tensor_value_info("key", f, ["T", hkv * d]),
                  helper.make_tensor_value_info("value", f, ["T", hkv * d])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in INPUT_NAMES[3:]]
    node = helper.make_node(op, [*heads, *INPUT_NAMES[3:]], ["out"], domain=domain, layer_idx=0,
                            num_heads=hq, num_kv_heads=hkv, head_size=d, **attrs)
    g = helper.make_graph([node], "alibi", inputs, [helper.make_tensor_value_info("out", f, ["T", hq * d])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)])
    return m.SerializeToString()


def _node_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ("scale", "sliding_window", "alibi_max_bias")}


@pytest.mark.parametrize("window", [0, 16])
def test_native_ort_op(window):
    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(30 + window, hq=hq, hkv=hkv, d=d, bs=8, window=window, pad_rows=1)
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    session = native_session(_graph("PagedAttention", hq, hkv, d, _node_attrs(attrs)))
    pool = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, inputs)
    np.testing.assert_array_equal(pool[0][0], k_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_native_rotary_ort_op():
    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(41, hq=hq, hkv=hkv, d=d, bs=8, seqs=[(40, 40), (75, 1), (19, 7)])
    rng = np.random.default_rng(5)
    t = inputs["query"].shape[0]
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32)
    ang = rng.uniform(0, 6.3, (t, d // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    meta = {n: inputs[n] for n in INPUT_NAMES[3:]}
    k_ref, v_ref = (c.copy() for c in caches)
    expected = reference.rotary_paged_attention(qkv, cos, sin, *meta.values(), k_ref, v_ref, **attrs)
    session = native_session(_graph("RotaryPagedAttention", hq, hkv, d, _node_attrs(attrs)))
    pool = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, {"qkv": qkv, "cos": cos, "sin": sin, **meta})
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_python_ort_op():
    import onnxruntime as ort

    from llmc.plugins.paged_attention import OP_TYPE, PYOP_EXTENDED, kv_binding, ort_op

    hq, hkv, d = 6, 2, 16
    inputs, caches, attrs = case(51, hq=hq, hkv=hkv, d=d, bs=8, window=16)
    expected, _ = run_reference(inputs, caches, attrs)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(ort_op.library_path())
    # The Python op of ALiBi nodes declares every optional attribute (the backend lowering fills in the absent).
    model = _graph(OP_TYPE + PYOP_EXTENDED, hq, hkv, d, {**_node_attrs(attrs), "softcap": 0.0, "attention_chunk": 0},
                   domain=ort_op.ORT_DOMAIN)
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    with kv_binding.bound_pool([tuple(c.copy() for c in caches)]):
        (got,) = session.run(None, inputs)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------------------------
# torch: the traced op and the CUDA engine's attention


def test_torch_custom_op_and_cuda_engine_attention():
    import torch

    import llmc.plugins.paged_attention.torch_op  # noqa: F401  (registers torch.ops.llmc)
    from llmc.plugins.paged_attention import kv_binding
    from llmc.runtime.torch_ops import paged_attention_torch

    hq, hkv, d = 12, 4, 32
    inputs, caches, attrs = case(61, hq=hq, hkv=hkv, d=d, bs=8, window=16, pad_rows=1)
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with kv_binding.bound_pool([tuple(c.copy() for c in caches)]):
        got = torch.ops.llmc.paged_attention(*t.values(), 0, hq, hkv, d, attrs["scale"], 16, 0.0, None, 8.0)
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)

    k, v = (torch.from_numpy(c.copy()) for c in caches)
    got = paged_attention_torch(*t.values(), k, v, num_heads=hq, num_kv_heads=hkv, scale=attrs["scale"],
                                sliding_window=16, alibi_max_bias=8.0)
    assert torch.equal(k, torch.from_numpy(k_ref)) and torch.equal(v, torch.from_numpy(v_ref))
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,window", [(1, 0), (1, 16), (4, 0), (2, 16)])
def test_triton_kernel(num_splits, window):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk
    from llmc.testing.paged_attention import check_case

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(150, 1), (37, 37), (90, 12), (1, 1)] if num_splits == 1 else [(300, 1), (129, 1), (64, 2)]
    inputs, caches, attrs = case(71 + num_splits + window, hq=12, hkv=4, d=32, bs=16, seqs=seqs, window=window)
    check_case(inputs, caches, attrs, atol={"fp32": ATOL}, num_splits=num_splits)
