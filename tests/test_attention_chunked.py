"""Chunked local attention (llama4) in every PagedAttention implementation, against the numpy reference.

With ``attention_chunk`` = C a query at position ``p`` sees the keys ``[floor(p / C) * C, p]``: absolute chunks
counted from position 0, not a sliding window (the first query of a chunk sees only itself). The reference is
first held to transformers' own chunked mask (``masking_utils.chunked_causal_mask_function``); then each
implementation is held to it on fresh random inputs: the C++ CPU kernel (every ISA; tiled and per-row loops, row
tiles and split contexts that straddle chunk boundaries; float16 caches), the native ONNX Runtime ops, the
Python ORT op, the torch custom op, the CUDA engine's torch attention and the Triton kernel (interpreted; one
launch and split-KV). Chunks of 16, 24 and 100 against block sizes of 5 to 16: boundaries inside blocks.
Tolerances as in test_attention_sinks.py.
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
MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12), (48, 25)]  # decode / prefill / chunks

kernel = load_kernel()


def case(seed, *, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, window=0, chunk=24, **kw):
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, **kw)
    return inputs, caches, {**attrs, "sliding_window": window, "attention_chunk": chunk}


def run_reference(inputs, caches, attrs):
    k, v = (c.copy() for c in caches)
    return reference.paged_attention(**inputs, k_cache=k, v_cache=v, **attrs), (k, v)


# -------------------------------------------------------------------------------------------
# The definition


@pytest.mark.parametrize("chunk", [8, 16, 32])
def test_reference_is_transformers_chunked_mask(chunk):
    """One sequence with cached positions and new rows that cross chunk boundaries: the reference equals
    softmax attention under transformers' chunked causal mask, and differs from plain causal attention."""
    import torch
    from transformers.masking_utils import chunked_causal_mask_function

    hq, hkv, d, bs, ctx, n_new = 4, 2, 32, 8, 45, 30
    inputs, caches, attrs = case(7 + chunk, hq=hq, hkv=hkv, d=d, bs=bs, seqs=[(ctx, n_new)], chunk=chunk)
    got, (k_cache, v_cache) = run_reference(inputs, caches, attrs)
    blocks = inputs["block_tables"][0, : -(-ctx // bs)]
    k = k_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].repeat(hq // hkv, 0)
    v = v_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx].repeat(hq // hkv, 0)
    q = inputs["query"].reshape(n_new, hq, d).transpose(1, 0, 2)
    fn = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))
    allowed = np.array([[bool(fn(0, 0, torch.tensor(qp), torch.tensor(kp))) for kp in range(ctx)]
                        for qp in range(ctx - n_new, ctx)])
    scores = np.einsum("hqd,hkd->hqk", q, k) * attrs["scale"]
    scores = torch.from_numpy(np.where(allowed[None], scores, -np.inf).astype(np.float32))
    want = torch.bmm(torch.softmax(scores, -1), torch.from_numpy(np.ascontiguousarray(v)))
    np.testing.assert_allclose(got, want.transpose(0, 1).reshape(n_new, hq * d).numpy(), rtol=RTOL, atol=ATOL)
    plain, _ = run_reference(inputs, caches, {**attrs, "attention_chunk": 0})
    assert np.abs(plain - got).max() > 1e-2  # the chunks matter in this case


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
    "tiled_chunk16": dict(chunk=16),
    "tiled_window_and_chunk": dict(window=20),
    "per_row": dict(d=36, bs=12, pad_rows=2),
    "per_row_bs5": dict(d=20, bs=5, chunk=16),
    "split_context": dict(seqs=[(2000, 1), (1337, 2), (700, 40)], q_scale=2.0, chunk=512),
    "per_row_split": dict(d=20, bs=5, seqs=[(900, 1), (40, 40)], chunk=600),
    "float16_cache": dict(cache_dtype=np.float16),
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
    g = helper.make_graph([node], "chunked", inputs, [helper.make_tensor_value_info("out", f, ["T", hq * d])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)])
    return m.SerializeToString()


def _node_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ("scale", "sliding_window", "attention_chunk")}


@pytest.mark.parametrize("chunk", [16, 24])
def test_native_ort_op(chunk):
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(30 + chunk, hq=hq, hkv=hkv, d=d, bs=8, chunk=chunk, pad_rows=1)
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    session = native_session(_graph("PagedAttention", hq, hkv, d, _node_attrs(attrs)))
    pool = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, inputs)
    np.testing.assert_array_equal(pool[0][0], k_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_native_rotary_ort_op():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(41, hq=hq, hkv=hkv, d=d, bs=8, seqs=[(40, 40), (75, 1), (19, 7)], chunk=16)
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

    hq, hkv, d = 4, 2, 16
    inputs, caches, attrs = case(51, hq=hq, hkv=hkv, d=d, bs=8, chunk=16)
    expected, _ = run_reference(inputs, caches, attrs)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(ort_op.library_path())
    model = _graph(OP_TYPE + PYOP_EXTENDED, hq, hkv, d, {**_node_attrs(attrs), "softcap": 0.0, "alibi_max_bias": 0.0},
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

    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(61, hq=hq, hkv=hkv, d=d, bs=8, chunk=16, pad_rows=1)
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with kv_binding.bound_pool([tuple(c.copy() for c in caches)]):
        got = torch.ops.llmc.paged_attention(*t.values(), 0, hq, hkv, d, attrs["scale"], 0, 0.0, None, 0.0, 16)
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)

    k, v = (torch.from_numpy(c.copy()) for c in caches)
    got = paged_attention_torch(*t.values(), k, v, num_heads=hq, num_kv_heads=hkv, scale=attrs["scale"],
                                attention_chunk=16)
    assert torch.equal(k, torch.from_numpy(k_ref)) and torch.equal(v, torch.from_numpy(v_ref))
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,chunk", [(1, 16), (1, 24), (4, 100), (2, 16)])
def test_triton_kernel(num_splits, chunk):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk
    from llmc.testing.paged_attention import check_case

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(150, 1), (37, 37), (90, 12), (1, 1)] if num_splits == 1 else [(300, 1), (129, 1), (64, 2), (70, 30)]
    inputs, caches, attrs = case(71 + num_splits + chunk, hq=8, hkv=2, d=32, bs=16, seqs=seqs, chunk=chunk)
    check_case(inputs, caches, attrs, atol={"fp32": ATOL}, num_splits=num_splits)
