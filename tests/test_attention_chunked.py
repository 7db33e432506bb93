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

from llmc.plugins.paged_attention.cpu import load_kernel  # noqa: E402
from llmc.testing import attention_variants as av  # noqa: E402
from llmc.testing.attention_variants import ATOL, RTOL, run_reference  # noqa: E402
from llmc.testing.paged_attention import make_case  # noqa: E402

MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12), (48, 25)]  # decode / prefill / chunks

kernel = load_kernel()


def case(seed, *, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, window=0, chunk=24, **kw):
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, **kw)
    return inputs, caches, {**attrs, "sliding_window": window, "attention_chunk": chunk}



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
    av.check_cpu_kernel(inputs, caches, attrs, atol=1e-4 if "split" in name else ATOL)


# -------------------------------------------------------------------------------------------
# ONNX Runtime: the native ops and the Python op


def _node_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ("scale", "sliding_window", "attention_chunk")}


@pytest.mark.parametrize("chunk", [16, 24])
def test_native_ort_op(chunk):
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(30 + chunk, hq=hq, hkv=hkv, d=d, bs=8, chunk=chunk, pad_rows=1)
    av.check_native_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)


def test_native_rotary_ort_op():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(41, hq=hq, hkv=hkv, d=d, bs=8, seqs=[(40, 40), (75, 1), (19, 7)], chunk=16)
    av.check_native_rotary_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)


def test_python_ort_op():
    from llmc.plugins.paged_attention import OP_TYPE, PYOP_EXTENDED

    hq, hkv, d = 4, 2, 16
    inputs, caches, attrs = case(51, hq=hq, hkv=hkv, d=d, bs=8, chunk=16)
    av.check_python_op(OP_TYPE + PYOP_EXTENDED, inputs, caches, attrs,
                       {**_node_attrs(attrs), "softcap": 0.0, "alibi_max_bias": 0.0}, hq, hkv, d)


# -------------------------------------------------------------------------------------------
# torch: the traced op and the CUDA engine's attention


def test_torch_custom_op_and_cuda_engine_attention():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(61, hq=hq, hkv=hkv, d=d, bs=8, chunk=16, pad_rows=1)
    av.check_torch_ops(inputs, caches, attrs, hq, hkv, d, custom_op_tail=(0, 0.0, None, 0.0, 16),
                       torch_kwargs=dict(attention_chunk=16))


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,chunk", [(1, 16), (1, 24), (4, 100), (2, 16)])
def test_triton_kernel(num_splits, chunk):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(150, 1), (37, 37), (90, 12), (1, 1)] if num_splits == 1 else [(300, 1), (129, 1), (64, 2), (70, 30)]
    inputs, caches, attrs = case(71 + num_splits + chunk, hq=8, hkv=2, d=32, bs=16, seqs=seqs, chunk=chunk)
    av.check_triton(inputs, caches, attrs, num_splits)
