"""Bidirectional spans (``attend_end``, Gemma 3's image tokens) in every PagedAttention implementation.

Gemma 3 lets the tokens of one image attend to each other both ways: transformers' masks are
``OR(causal, blockwise)`` on full-attention layers and ``AND(sliding_window, OR(causal, blockwise))`` on
sliding ones (``create_masks_for_vision_model``). llmc carries it as one optional input ``attend_end [T]``: row
``t`` at position ``q`` also sees the keys ``q < k < attend_end[t]``.

The definition is held to transformers twice: to ``create_masks_for_vision_model`` itself on a whole prompt, and to
its mask functions (``blockwise_overlay``, ``sliding_window_overlay``) on a chunk after a cached prefix. Every
implementation is then held, on fresh random steps, to a float64 attention built straight from that mask (image
groups, not attend_end): the numpy reference, the C++ CPU kernel (each ISA; tiled and per-row loops, split
contexts, float16 caches), the native ONNX Runtime ops (PagedAttention without and with sinks,
RotaryPagedAttention), the Python ORT op reached through the pyop lowering, the torch custom op (eager and its
ONNX translation), and the Triton kernel (interpreted; one launch and split-KV). Steps pack 2-3 sequences: a span
at position 0, one after a cached prefix, one that began in the cached prefix and ends in this chunk, one across
KV blocks and row tiles; GQA; sliding windows smaller and larger than a span. Rows outside spans get random
values ``<= q + 1`` (causal by definition), padding rows garbage (never read).

Without attend_end every implementation must compute what it did before, bit for bit: checked as absent ==
all-causal values, bit for bit, per implementation (the engines' bytes are tests/test_same_engines.py's).
Tolerances (float32 kernels against float64): those of testing/attention_variants.py; split contexts 1e-4.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does it too)

from llmc.plugins.paged_attention.cpu import load_kernel, paged_attention_cpu  # noqa: E402
from llmc.testing import attention_variants as av  # noqa: E402
from llmc.testing.attention_variants import ATOL, RTOL, run_reference  # noqa: E402
from llmc.testing.paged_attention import make_case  # noqa: E402

kernel = load_kernel()

Span = tuple[int, int]  # positions [a, b) of one image
Seq = tuple[int, int, list[Span]]  # (context length after the step, new rows, image spans)

# Decode, a prompt with an image at position 0, a chunk after a cached prefix holding a whole image and the end of
# one that began in the prefix, a prompt whose image crosses blocks and row tiles.
MIXED: list[Seq] = [(70, 1, []), (37, 37, [(0, 12), (20, 31)]), (90, 30, [(55, 64), (66, 80), (84, 88)]),
                    (48, 48, [(5, 41)])]


def make_step(seed: int, seqs: list[Seq], *, hq: int = 8, hkv: int = 2, d: int = 64, bs: int = 16, window: int = 0,
              pad_rows: int = 0, **kw) -> tuple[dict, tuple, dict]:
    """A random packed step (make_case) with attend_end from the sequences' spans: a row inside span [a, b) gets
    b, any other row a random value <= its position + 1 (causal), a padding row garbage."""
    rng = np.random.default_rng(seed)
    inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=[(c, n) for c, n, _ in seqs],
                                      pad_rows=pad_rows, **kw)
    ends = []
    for ctx, n_new, spans in seqs:
        assert all(b <= ctx for a, b in spans if b > ctx - n_new), "a span of this step's rows must end in it"
        for p in range(ctx - n_new, ctx):
            inside = [b for a, b in spans if a <= p < b]
            ends.append(inside[0] if inside else int(rng.integers(-3, p + 2)))
    ends += [10**9] * pad_rows
    return inputs, caches, {**attrs, "sliding_window": window, "attend_end": np.array(ends, dtype=np.int64)}


def definition_mask(ctx: int, n_new: int, spans: list[Span], window: int) -> np.ndarray:
    """[n_new, ctx] visible(q, k) by transformers' definition: (k <= q OR same image) AND (k > q - window)."""
    group = np.full(ctx, -1)
    for i, (a, b) in enumerate(spans):
        group[a:b] = i
    q = np.arange(ctx - n_new, ctx)[:, None]
    k = np.arange(ctx)[None, :]
    visible = (k <= q) | ((group[q] == group[k]) & (group[q] >= 0))
    return visible & (k > q - window) if window > 0 else visible


def attention64(inputs: dict, caches: tuple, attrs: dict, masks: list[np.ndarray]) -> np.ndarray:
    """float64 attention of each sequence's rows under ``masks[s]`` ([n_new, ctx]); keys of older positions from
    the caches as they were, this step's from the key/value inputs (no cache write involved)."""
    hq, hkv, scale = attrs["num_heads"], attrs["num_kv_heads"], attrs["scale"]
    k_cache, v_cache = (c.astype(np.float64) for c in caches)
    bs, d = k_cache.shape[2], k_cache.shape[3]
    qsl, ctxs, tables = inputs["query_start_loc"], inputs["context_lens"], inputs["block_tables"]
    out = np.zeros(inputs["query"].shape, dtype=np.float64)
    for s, mask in enumerate(masks):
        start, end, ctx = int(qsl[s]), int(qsl[s + 1]), int(ctxs[s])
        n_new, old = end - start, ctx - (end - start)
        pos = np.arange(old)
        blk, off = tables[s, pos // bs], pos % bs
        k = np.concatenate([k_cache[blk, :, off, :], inputs["key"][start:end].reshape(n_new, hkv, d)])
        v = np.concatenate([v_cache[blk, :, off, :], inputs["value"][start:end].reshape(n_new, hkv, d)])
        q = inputs["query"][start:end].astype(np.float64).reshape(n_new, hq, d)
        for h in range(hq):
            scores = np.where(mask, q[:, h] @ k[:, h // (hq // hkv)].T * scale, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[start:end, h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ v[:, h // (hq // hkv)]
    return out


def expected64(inputs: dict, caches: tuple, attrs: dict, seqs: list[Seq]) -> np.ndarray:
    window = attrs.get("sliding_window", 0)
    return attention64(inputs, caches, attrs, [definition_mask(c, n, sp, window) for c, n, sp in seqs])


def check_definition(got: np.ndarray, inputs: dict, caches: tuple, attrs: dict, seqs: list[Seq],
                     atol: float = ATOL) -> None:
    np.testing.assert_allclose(got, expected64(inputs, caches, attrs, seqs), rtol=RTOL, atol=atol)


# -------------------------------------------------------------------------------------------
# The definition: transformers' Gemma 3 masks, and the reference held to them


def test_definition_is_transformers_gemma3_masks():
    """A whole prompt with two images (one at position 0): transformers' create_masks_for_vision_model (full and
    sliding layers) equals the definition's mask, and the reference with attend_end computes attention under it."""
    import torch
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    length, window, hq, hkv, d = 40, 6, 4, 2, 16
    token_type = torch.zeros(1, length, dtype=torch.long)
    token_type[0, 0:9] = 1
    token_type[0, 15:33] = 1  # longer than the window
    spans = [(0, 9), (15, 33)]
    cfg = Gemma3TextConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d,
                           num_hidden_layers=2, intermediate_size=32, vocab_size=32, sliding_window=window)
    cfg._attn_implementation = "sdpa"
    masks = create_masks_for_vision_model(cfg, torch.zeros(1, length, hq * d), None, None,
                                          torch.arange(length)[None], get_block_sequence_ids_for_mask(token_type))
    seqs: list[Seq] = [(length, length, spans)]
    for layer, w in (("full_attention", 0), ("sliding_attention", window)):
        hf = masks[layer][0, 0].numpy()
        np.testing.assert_array_equal(hf, definition_mask(length, length, spans, w), err_msg=layer)
        inputs, caches, attrs = make_step(1 + w, seqs, hq=hq, hkv=hkv, d=d, bs=8, window=w)
        want = attention64(inputs, caches, attrs, [hf])
        got, _ = run_reference(inputs, caches, attrs)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=layer)
        got = paged_attention_cpu(**inputs, k_cache=caches[0].copy(), v_cache=caches[1].copy(), **attrs)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=layer)
        causal, _ = run_reference(inputs, caches, {**attrs, "attend_end": None})
        assert np.abs(causal - got).max() > 1e-2  # the images matter in this case


@pytest.mark.parametrize("window", [0, 5, 40])
def test_definition_is_transformers_overlays_after_a_cached_prefix(window):
    """A chunk after a cached prefix, at absolute positions: transformers' mask functions (OR(causal, blockwise),
    AND(sliding_window, ...)) give the definition's mask; one image began in the prefix, one lies in the chunk."""
    import torch
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )

    ctx, n_new, spans = 60, 25, [(30, 42), (45, 57)]
    ids = torch.full((1, ctx), -1)
    for i, (a, b) in enumerate(spans):
        ids[0, a:b] = i
    fn = or_masks(causal_mask_function, blockwise_overlay(ids))
    if window:
        fn = and_masks(sliding_window_overlay(window), fn)
    hf = np.array([[bool(fn(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(ctx)]
                   for q in range(ctx - n_new, ctx)])
    np.testing.assert_array_equal(hf, definition_mask(ctx, n_new, spans, window))
    inputs, caches, attrs = make_step(3 + window, [(ctx, n_new, spans)], hq=4, hkv=1, d=32, bs=8, window=window)
    got, _ = run_reference(inputs, caches, attrs)
    np.testing.assert_allclose(got, attention64(inputs, caches, attrs, [hf]), rtol=RTOL, atol=ATOL)


REF_CASES = {
    "mixed": dict(seqs=MIXED),
    "window_smaller_than_spans": dict(seqs=MIXED, window=5),
    "window_larger_than_spans": dict(seqs=MIXED, window=40),
    "mha_per_row_shapes": dict(seqs=MIXED[1:3], hq=3, hkv=3, d=20, bs=5, pad_rows=2),
}


@pytest.mark.parametrize("name", list(REF_CASES))
def test_reference_is_the_definition(name):
    kw = dict(REF_CASES[name])
    seqs = kw.pop("seqs")
    inputs, caches, attrs = make_step(11 + len(name), seqs, **kw)
    got, _ = run_reference(inputs, caches, attrs)
    check_definition(got, inputs, caches, attrs, seqs)


def test_reference_refuses_keys_beyond_the_context():
    inputs, caches, attrs = make_step(5, [(20, 20, [(2, 20)])], hq=2, hkv=1, d=8, bs=4)
    attrs["attend_end"][3] = 21
    with pytest.raises(ValueError, match="attend_end"):
        run_reference(inputs, caches, attrs)


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
    "tiled": dict(seqs=MIXED),
    "tiled_window_smaller": dict(seqs=MIXED, window=5),
    "tiled_window_larger": dict(seqs=MIXED, window=40),
    "tiled_mha": dict(seqs=MIXED, hq=4, hkv=4, d=32, bs=8),  # one head per group: 32-row tiles
    "per_row": dict(seqs=MIXED, d=36, bs=12, pad_rows=2),
    "per_row_window": dict(seqs=MIXED, d=20, bs=5, window=7),
    # Few rows, long contexts: split into block ranges (parts with no visible key for some rows included).
    "split_context": dict(seqs=[(2000, 1, []), (1337, 2, []), (700, 40, [(655, 668), (672, 699)])], q_scale=2.0),
    "per_row_split": dict(seqs=[(900, 1, []), (600, 30, [(575, 590), (591, 600)])], d=20, bs=5),
    "float16_cache": dict(seqs=MIXED, cache_dtype=np.float16),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel(isa, name):
    kw = dict(CPU_CASES[name])
    seqs = kw.pop("seqs")
    inputs, caches, attrs = make_step(abs(hash(name)) % 2**32, seqs, **kw)
    atol = 1e-4 if "split" in name else ATOL
    got = av.check_cpu_kernel(inputs, caches, attrs, atol=atol)
    if "float16" not in name:  # (the definition reads the float32 inputs; the kernel their float16 rounding)
        check_definition(got, inputs, caches, attrs, seqs, atol=atol)


@pytest.mark.parametrize("tiled", [True, False])
def test_cpu_kernel_isas_agree(tiled):
    """Every ISA this CPU runs gives the same output within float32 rounding of the reduction order."""
    shape = dict(d=64, bs=16) if tiled else dict(d=36, bs=12)
    inputs, caches, attrs = make_step(21, MIXED, window=9, **shape)
    outs = {}
    for name in av.ISAS:
        try:
            kernel._set_isa(name)
        except ValueError:
            continue
        try:
            outs[name] = paged_attention_cpu(**inputs, k_cache=caches[0].copy(), v_cache=caches[1].copy(), **attrs)
        finally:
            kernel._set_isa("auto")
    assert "baseline" in outs
    for name, got in outs.items():
        np.testing.assert_allclose(got, outs["baseline"], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("shape", [dict(d=64, bs=16), dict(d=36, bs=12)])
def test_cpu_kernel_without_spans_is_bit_identical(isa, shape):
    """attend_end absent, all zeros, or every row's own position + 1: the same bits (the causal arithmetic is
    untouched by the option)."""
    seqs = [(c, n, []) for c, n, _ in MIXED]
    inputs, caches, attrs = make_step(31, seqs, window=9, **shape)
    pos = np.concatenate([np.arange(c - n, c) for c, n, _ in seqs])
    outs = [paged_attention_cpu(**inputs, k_cache=caches[0].copy(), v_cache=caches[1].copy(),
                                **{**attrs, "attend_end": ae}) for ae in (None, np.zeros_like(pos), pos + 1)]
    for got in outs[1:]:
        np.testing.assert_array_equal(got, outs[0])


def test_cpu_kernel_errors():
    inputs, caches, attrs = make_step(41, [(20, 20, [(2, 20)])], hq=2, hkv=1, d=8, bs=4)
    k, v = caches[0].copy(), caches[1].copy()
    bad = attrs["attend_end"].copy()
    bad[3] = 21
    with pytest.raises(ValueError, match=r"attend_end\[3\] = 21 exceeds context_lens = 20"):
        paged_attention_cpu(**inputs, k_cache=k, v_cache=v, **{**attrs, "attend_end": bad})
    np.testing.assert_array_equal(k, caches[0])  # refused before any write
    with pytest.raises(ValueError, match="one entry per row"):
        paged_attention_cpu(**inputs, k_cache=k, v_cache=v, **{**attrs, "attend_end": bad[:-1]})


# -------------------------------------------------------------------------------------------
# ONNX Runtime: the native ops, the Python op through the pyop lowering, the rotary fusion


def _node_attrs(attrs: dict) -> dict:
    return {k: attrs[k] for k in ("scale", "sliding_window")}


@pytest.mark.parametrize("window,sinks", [(0, False), (6, False), (0, True)])
def test_native_ort_op(window, sinks):
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = make_step(50 + window + sinks, MIXED, hq=hq, hkv=hkv, d=d, bs=8, window=window,
                                      pad_rows=1)
    if sinks:
        attrs["sinks"] = np.random.default_rng(1).normal(size=hq).astype(np.float32)
    got = av.check_native_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)
    if not sinks:
        check_definition(got, inputs, caches, attrs, MIXED)


def test_native_ort_op_refuses_a_wrong_shape():
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    from llmc.plugins.paged_attention import ort_native
    from llmc.testing.ort_sessions import native_session

    hq, hkv, d = 4, 2, 16
    inputs, caches, attrs = make_step(55, MIXED[:2], hq=hq, hkv=hkv, d=d, bs=8)
    session = native_session(av.attention_graph("PagedAttention", hq, hkv, d, _node_attrs(attrs), attend_end=True))
    with ort_native.bound_pool([tuple(c.copy() for c in caches)]):
        with pytest.raises(RuntimeException, match="attend_end must have one entry per query row"):
            session.run(None, {**inputs, "attend_end": attrs["attend_end"][:-1]})
        bad = attrs["attend_end"].copy()
        bad[0] = 71  # the decode row's sequence holds 70 positions
        with pytest.raises(RuntimeException, match="exceeds context_lens"):
            session.run(None, {**inputs, "attend_end": bad})


def test_native_rotary_ort_op():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = make_step(61, MIXED, hq=hq, hkv=hkv, d=d, bs=8, window=5)
    av.check_native_rotary_op(inputs, caches, attrs, _node_attrs(attrs), hq, hkv, d)


@pytest.mark.parametrize("sinks", [False, True])
def test_python_ort_op_through_the_pyop_lowering(sinks):
    """An llmc node with attend_end (input 7 empty without sinks), lowered for the Python-op route
    (passes/ort/contrib_ops), runs in onnxruntime-extensions and equals the reference."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from llmc.passes.ort.contrib_ops import lower_llmc_ops, set_opsets
    from llmc.plugins.paged_attention import kv_binding, ort_op

    hq, hkv, d = 4, 2, 16
    inputs, caches, attrs = make_step(71 + sinks, MIXED, hq=hq, hkv=hkv, d=d, bs=8, window=6)
    if sinks:
        attrs["sinks"] = np.random.default_rng(2).normal(size=hq).astype(np.float32)
    model = ir.from_proto(onnx.load_from_string(av.attention_graph(
        "PagedAttention", hq, hkv, d, {**_node_attrs(attrs), "softcap": 0.0}, sinks=attrs.get("sinks"),
        attend_end=True)))
    assert lower_llmc_ops(model, "pyop") == 1
    set_opsets(model, "pyop")
    (node,) = model.graph
    assert node.op_type == ("PagedAttentionSinks" if sinks else "PagedAttention") + "AttendEndExt"
    assert [v.name for v in node.inputs][-1] == "attend_end" and None not in node.inputs
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(ort_op.library_path())
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    with kv_binding.bound_pool([tuple(c.copy() for c in caches)]):
        (got,) = session.run(None, {**inputs, "attend_end": attrs["attend_end"]})
    expected, _ = run_reference(inputs, caches, attrs)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_rotary_fusion_carries_attend_end():
    """Split + RotaryEmbedding x2 + Reshape x3 + PagedAttention with attend_end (no sinks) fuses into one
    RotaryPagedAttention whose input 7 stays empty and input 8 is attend_end, and computes the unfused result."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    from llmc.passes.ort.rotary_attention import fuse_rotary_attention
    from llmc.plugins.paged_attention import INPUT_NAMES, ROTARY_OP_TYPE, ort_native
    from llmc.testing.ort_sessions import native_session

    hq, hkv, d = 4, 2, 16
    seq = list(INPUT_NAMES[3:])
    i64, f = TensorProto.INT64, TensorProto.FLOAT
    attrs_ = dict(layer_idx=0, num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d ** -0.5, sliding_window=0,
                  softcap=0.0)
    nodes = [
        helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
        helper.make_node("RotaryEmbedding", ["q", "cos", "sin"], ["qr"], num_heads=hq, interleaved=0),
        helper.make_node("RotaryEmbedding", ["k", "cos", "sin"], ["kr"], num_heads=hkv, interleaved=0),
        helper.make_node("Reshape", ["qr", "shape_q"], ["q2"]),
        helper.make_node("Reshape", ["kr", "shape_kv"], ["k2"]),
        helper.make_node("Reshape", ["v", "shape_kv"], ["v2"]),
        helper.make_node("PagedAttention", ["q2", "k2", "v2", *seq, "", "attend_end"], ["out"], domain="llmc",
                         **attrs_),
    ]
    init = [helper.make_tensor("sizes", i64, [3], [hq * d, hkv * d, hkv * d]),
            helper.make_tensor("shape_q", i64, [2], [-1, hq * d]),
            helper.make_tensor("shape_kv", i64, [2], [-1, hkv * d])]
    graph_inputs = [helper.make_tensor_value_info("qkv", f, [1, "T", (hq + 2 * hkv) * d]),
                    helper.make_tensor_value_info("cos", f, [1, "T", d // 2]),
                    helper.make_tensor_value_info("sin", f, [1, "T", d // 2]),
                    *[helper.make_tensor_value_info(n, i64, None) for n in seq],
                    helper.make_tensor_value_info("attend_end", i64, ["T"])]
    g = helper.make_graph(nodes, "unfused", graph_inputs, [helper.make_tensor_value_info("out", f, ["T", hq * d])],
                          initializer=init)
    unfused = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("llmc", 1)])
    model = ir.from_proto(unfused)
    assert fuse_rotary_attention(model) == 1
    (node,) = [n for n in model.graph if n.op_type == ROTARY_OP_TYPE]
    assert len(node.inputs) == 9 and node.inputs[7] is None and node.inputs[8].name == "attend_end"

    inputs, caches, attrs = make_step(81, MIXED, hq=hq, hkv=hkv, d=d, bs=8)
    rng = np.random.default_rng(3)
    t = inputs["query"].shape[0]
    ang = rng.uniform(0, 6.3, (1, t, d // 2)).astype(np.float32)
    feeds = {"qkv": rng.standard_normal((1, t, (hq + 2 * hkv) * d)).astype(np.float32), "cos": np.cos(ang),
             "sin": np.sin(ang), **{n: inputs[n] for n in seq}, "attend_end": attrs["attend_end"]}
    outs = []
    for proto in (unfused, ir.to_proto(model)):
        pool = [tuple(c.copy() for c in caches)]
        with ort_native.bound_pool(pool):
            (out,) = native_session(proto.SerializeToString()).run(None, feeds)
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    causal = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(causal):
        (plain,) = native_session(unfused.SerializeToString()).run(
            None, {**feeds, "attend_end": np.zeros(t, dtype=np.int64)})
    assert np.abs(plain - outs[0]).max() > 1e-2  # attend_end reached the kernel


def test_native_ops_without_spans_are_bit_identical():
    """The native op with attend_end all zeros equals the node without the input, bit for bit."""
    from llmc.plugins.paged_attention import ort_native
    from llmc.testing.ort_sessions import native_session

    hq, hkv, d = 8, 2, 32
    seqs = [(c, n, []) for c, n, _ in MIXED]
    inputs, caches, attrs = make_step(91, seqs, hq=hq, hkv=hkv, d=d, bs=8, window=9)
    outs = []
    for with_input in (False, True):
        session = native_session(av.attention_graph("PagedAttention", hq, hkv, d, _node_attrs(attrs),
                                                    attend_end=with_input))
        feeds = {**inputs, "attend_end": np.zeros_like(attrs["attend_end"])} if with_input else inputs
        with ort_native.bound_pool([tuple(c.copy() for c in caches)]):
            outs.append(session.run(None, feeds)[0])
    np.testing.assert_array_equal(outs[1], outs[0])


def test_tensorrt_lowering_refuses_attend_end():
    import onnx
    import onnx_ir as ir

    from llmc.errors import UnsupportedError
    from llmc.passes.tensorrt.lowering import lower_paged_attention

    hq, hkv, d = 4, 2, 16
    model = ir.from_proto(onnx.load_from_string(av.attention_graph(
        "PagedAttention", hq, hkv, d, {"scale": 0.25, "sliding_window": 0, "softcap": 0.0}, attend_end=True)))
    with pytest.raises(UnsupportedError, match="bidirectional attention spans"):
        lower_paged_attention(model, max_seq_len=64)


# -------------------------------------------------------------------------------------------
# torch: the traced op, eager and exported


def test_torch_custom_op():
    hq, hkv, d = 8, 2, 32
    inputs, caches, attrs = make_step(101, MIXED, hq=hq, hkv=hkv, d=d, bs=8, window=5, pad_rows=1)
    av.check_torch_custom_op(inputs, caches, attrs, hq, hkv, d, custom_op_tail=(5, 0.0, None, 0.0, 0))


@pytest.mark.parametrize("sinks", [False, True])
def test_torch_op_exports_attend_end_as_input_8(sinks):
    """torch.onnx.export with the frontend's translation: attend_end is the node's input 8 (input 7 empty without
    sinks), a graph input of the exported model; without it the node keeps its 7 (or 8) inputs."""
    import warnings

    import torch

    from llmc.plugins.paged_attention import onnx_schema, torch_op

    onnx_schema.register()
    hq, hkv, d = 4, 2, 8

    class Attention(torch.nn.Module):
        def __init__(self, spans: bool):
            super().__init__()
            self.spans = spans
            self.sinks = torch.nn.Parameter(torch.zeros(hq)) if sinks else None

        def forward(self, q, k, v, slot_mapping, block_tables, context_lens, query_start_loc, attend_end):
            return torch.ops.llmc.paged_attention(q, k, v, slot_mapping, block_tables, context_lens, query_start_loc,
                                                  0, hq, hkv, d, 0.3, 0, 0.0, self.sinks, 0.0, 0,
                                                  attend_end=attend_end if self.spans else None)

    t = torch.export.Dim("T", min=2)
    example = (torch.zeros(3, hq * d), torch.zeros(3, hkv * d), torch.zeros(3, hkv * d),
               torch.zeros(3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long),
               torch.tensor([0, 3]), torch.zeros(3, dtype=torch.long))
    names = ["q", "k", "v", "slot_mapping", "block_tables", "context_lens", "query_start_loc", "attend_end"]
    dynamic = {n: ({0: t} if n in ("q", "k", "v", "slot_mapping", "attend_end") else None) for n in names}
    for spans in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            proto = torch.onnx.export(Attention(spans), example, input_names=names, dynamo=True, opset_version=23,
                                      dynamic_shapes=dynamic, optimize=False, verbose=False,
                                      custom_translation_table={
                                          torch.ops.llmc.paged_attention.default: torch_op.onnx_translation},
                                      ).model_proto
        (node,) = [n for n in proto.graph.node if n.op_type == "PagedAttention"]
        head = names[:7]
        if spans:
            assert list(node.input)[:7] == head and list(node.input)[8] == "attend_end"
            assert (node.input[7] != "") == sinks
        else:
            assert len(node.input) == 7 + sinks


# -------------------------------------------------------------------------------------------
# The Triton kernel (interpreted)


@pytest.mark.parametrize("num_splits,window", [(1, 0), (1, 5), (2, 0)])
def test_triton_kernel(num_splits, window):
    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import triton_kernel as tk

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = MIXED[:3] if num_splits == 1 else [(300, 1, []), (129, 1, []), (70, 30, [(38, 45), (50, 62)])]
    inputs, caches, attrs = make_step(111 + num_splits + window, seqs, hq=8, hkv=2, d=32, bs=16, window=window,
                                      pad_rows=1)
    got = av.check_triton(inputs, caches, attrs, num_splits)
    check_definition(got, inputs, caches, attrs, seqs)


def test_triton_kernel_without_spans_is_bit_identical():
    pytest.importorskip("triton")
    import torch

    from llmc.plugins.paged_attention import triton_kernel as tk

    if not tk.interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process")
    seqs = [(c, n, []) for c, n, _ in MIXED[:3]]
    inputs, caches, attrs = make_step(121, seqs, hq=8, hkv=2, d=32, bs=16, window=7)
    outs = [tk.paged_attention(*(torch.from_numpy(inputs[n]) for n in inputs),
                               *(torch.from_numpy(c.copy()) for c in caches), num_heads=8, num_kv_heads=2,
                               scale=attrs["scale"], sliding_window=7, attend_end=ae)
            for ae in (None, torch.zeros(inputs["query"].shape[0], dtype=torch.int64))]
    assert torch.equal(outs[0], outs[1])


def test_aot_parameters_take_attend_end_after_kv_scales_and_sinks():
    """The CUDA engine's launch order (aot.params_for): attend_end after kv_scales, or after the sinks."""
    from llmc.plugins.paged_attention import aot
    from llmc.plugins.paged_attention.triton_kernel import KernelConfig

    base = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, scale=0.25)
    assert aot.params_for(KernelConfig(**base)) == aot.PARAMS
    with_end = aot.params_for(KernelConfig(**base, attend_end=True))
    assert with_end[with_end.index("kv_scales") + 1] == "attend_end" and len(with_end) == len(aot.PARAMS) + 1
    both = aot.params_for(KernelConfig(**base, attend_end=True, sinks=True))
    assert both[both.index("kv_scales") + 1: both.index("kv_scales") + 3] == ("sinks", "attend_end")


@pytest.mark.parametrize("sinks", [False, True])
def test_aot_kernel_with_attend_end_compiles(sinks):
    """The CUDA engine's ahead-of-time kernel with attend_end (no GPU needed): its PTX entry takes exactly the
    parameters params_for lists, ptxas accepts it, and its manifest configuration says attend_end."""
    import re

    pytest.importorskip("triton")
    from llmc.plugins.paged_attention import aot
    from llmc.plugins.paged_attention.triton_kernel import KernelConfig

    cfg = KernelConfig(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, scale=0.125, act_dtype="bf16",
                       cache_dtype="bf16", sliding_window=512, block_m=64, sinks=sinks, attend_end=True)
    (k,) = aot.compile_ptx(cfg, [90])
    assert k.params == aot.params_for(cfg) and k.config["attend_end"] is True
    entry = re.search(r"\.entry\s+(\w+)\s*\((.*?)\)", k.ptx, re.S)
    assert len([p for p in entry.group(2).split(",") if p.strip()]) == len(k.params)
    assert aot.assemble(k.ptx, 90)
