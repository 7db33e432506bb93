"""Attention sinks (gpt-oss) in every PagedAttention implementation, against the numpy reference.

A sink is one learned logit per query head that enlarges that head's softmax denominator and adds
nothing to the value sum: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``. The reference is first
held to transformers' own definition (gpt_oss ``eager_attention_forward``, which appends the sink as a last
column of the logits and drops it after the softmax); then each implementation is held to the reference on
fresh random inputs: the C++ CPU kernel (every ISA; the tiled and the per-row loops; split contexts, where
the sink must join the merged denominator exactly once; float16 caches), the native ONNX Runtime ops
(``PagedAttention`` and the fused ``RotaryPagedAttention`` with sinks as their optional 8th input), the Python
ORT op, the torch custom op the frontend traces, the CUDA engine's torch attention, and the Triton kernel
(under the interpreter, one launch and split-KV). Sinks are drawn fresh (normal, scaled by 2, one head's
pinned high so that the sink dominates its scores and one low), never zeros; steps mix prefill chunks and
decodes, with and without a sliding window (gpt-oss alternates 128-token windows with full attention).
Tolerances as in test_paged_attention_kernel.py (whose docstring explains them).
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

MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12)]  # decode / whole prefill / chunks

kernel = load_kernel()


def sinks_for(rng, hq: int) -> np.ndarray:
    s = (2.0 * rng.standard_normal(hq)).astype(np.float32)
    s[0] = 6.0 + rng.random()  # above every score of this head: the max is the sink's
    s[-1] = -5.0 - rng.random()
    return s


def case(seed, *, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, window=0, **kw):
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, **kw)
    attrs = {**attrs, "sliding_window": window, "sinks": sinks_for(rng, hq)}
    return inputs, caches, attrs



# -------------------------------------------------------------------------------------------
# The definition


@pytest.mark.parametrize("window", [0, 16])
def test_reference_is_transformers_gpt_oss_attention(window):
    """One sequence with cached positions and new rows: the reference equals transformers' gpt_oss eager
    attention over the same keys and values (causal, GQA, optional window), and differs from attention
    without the sinks."""
    import types

    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    hq, hkv, d, bs, ctx, n_new = 8, 2, 32, 8, 45, 13
    inputs, caches, attrs = case(7 + window, hq=hq, hkv=hkv, d=d, bs=bs, seqs=[(ctx, n_new)], window=window)
    got, (k_cache, v_cache) = run_reference(inputs, caches, attrs)
    blocks = inputs["block_tables"][0, : -(-ctx // bs)]
    k = k_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    v = v_cache[blocks].transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    q = inputs["query"].reshape(n_new, hq, d).transpose(1, 0, 2)
    qpos, kpos = np.arange(ctx - n_new, ctx)[:, None], np.arange(ctx)[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    mask = torch.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, sinks=torch.from_numpy(attrs["sinks"]),
                                   training=False)
    out, _ = eager_attention_forward(module, torch.from_numpy(q)[None], torch.from_numpy(k)[None],
                                     torch.from_numpy(v)[None], mask, scaling=attrs["scale"])
    want = out[0].reshape(n_new, hq * d).numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    plain, _ = run_reference(inputs, caches, {**attrs, "sinks": None})
    assert np.abs(plain - got).max() > 1e-2  # the sinks matter in this case


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
    "per_row_window": dict(d=36, bs=12, window=16, pad_rows=2),
    "split_context": dict(seqs=[(2000, 1), (1337, 2)], q_scale=2.0),
    "split_context_window": dict(seqs=[(1500, 1), (900, 3)], window=300),
    "per_row_split": dict(d=20, bs=5, seqs=[(900, 1), (40, 40)]),
    "float16_cache": dict(cache_dtype=np.float16, window=16),
    "mha": dict(hq=4, hkv=4, d=16, bs=8),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel(isa, name):
    inputs, caches, attrs = case(abs(hash(name)) % 2**32, **CPU_CASES[name])
    av.check_cpu_kernel(inputs, caches, attrs, atol=1e-4 if "split" in name else ATOL)


def test_cpu_kernel_refuses_bad_sinks():
    from llmc.plugins.paged_attention.cpu import paged_attention_cpu

    inputs, caches, attrs = case(1)
    with pytest.raises(ValueError, match="sinks must have shape"):
        paged_attention_cpu(**inputs, k_cache=caches[0], v_cache=caches[1], **{**attrs, "sinks": attrs["sinks"][:3]})


# -------------------------------------------------------------------------------------------
# ONNX Runtime: the native ops (sinks as their optional 8th input) and the Python op


@pytest.mark.parametrize("window", [0, 16])
def test_native_ort_op(window):
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(30 + window, hq=hq, hkv=hkv, d=d, bs=8, window=window, pad_rows=1)
    av.check_native_op(inputs, caches, attrs, {"scale": attrs["scale"], "sliding_window": window}, hq, hkv, d)


def test_native_rotary_ort_op():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(41, hq=hq, hkv=hkv, d=d, bs=8, window=16, seqs=[(40, 40), (75, 1), (19, 7)])
    av.check_native_rotary_op(inputs, caches, attrs, {"scale": attrs["scale"], "sliding_window": 16}, hq, hkv, d)


def test_python_ort_op():
    from llmc.plugins.paged_attention import ort_op

    hq, hkv, d = 4, 2, 16
    inputs, caches, attrs = case(51, hq=hq, hkv=hkv, d=d, bs=8, window=16)
    av.check_python_op(ort_op.SINKS_OP_TYPE, inputs, caches, attrs,
                       {"scale": attrs["scale"], "sliding_window": 16, "softcap": 0.0}, hq, hkv, d)


# -------------------------------------------------------------------------------------------
# torch: the traced op and the CUDA engine's attention


def test_torch_custom_op_and_cuda_engine_attention():
    import torch

    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = case(61, hq=hq, hkv=hkv, d=d, bs=8, window=16, pad_rows=1)
    sinks = torch.from_numpy(attrs["sinks"])
    av.check_torch_ops(inputs, caches, attrs, hq, hkv, d, custom_op_tail=(16, 0.0, sinks),
                       torch_kwargs=dict(sliding_window=16, sinks=sinks))


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,window", [(1, 0), (1, 16), (4, 0), (2, 16)])
def test_triton_kernel(num_splits, window):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(150, 1), (37, 37), (90, 12), (1, 1)] if num_splits == 1 else [(300, 1), (129, 1), (64, 2)]
    inputs, caches, attrs = case(71 + num_splits + window, hq=8, hkv=2, d=32, bs=16, seqs=seqs, window=window)
    av.check_triton(inputs, caches, attrs, num_splits)
