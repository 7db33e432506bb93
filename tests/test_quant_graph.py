"""The quantization graph pass, differentially: the rewritten graph (MatMulNBits, GatherBlockQuantized,
FP8/NVFP4 decode subgraphs, AWQ folds) run in ONNX Runtime must compute what the original graph
computes with its weights replaced by the numpy codecs' dequantized weights."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest

from llmc.compiler.verify import KVShape, random_step, run_graph
from llmc.passes import quantize as graph
from llmc.quant import fp8, int4, int8, nvfp4
from llmc.quant.collect import CalibrationResult, LinearQuant
from llmc.quant.minifloat import E4M3
from llmc.quant.recipe import QuantRecipe


@pytest.fixture(scope="module")
def traced(tiny_llama):
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.frontend import trace
    from llmc.compiler.pipeline import passes_for, run_pipeline

    t = trace(load_checkpoint(tiny_llama))
    run_pipeline(t.model, passes_for("cpu"))
    feeds, pool = random_step(np.random.default_rng(0), t.vocab_size,
                              KVShape(t.num_layers, t.num_kv_heads, t.head_size))
    return t.model, feeds, pool


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _with_weights(model: ir.Model, nk_of) -> ir.Model:
    """A clone whose linear weights are replaced by ``nk_of(site, w_nk)`` (float32 ``[N, K]``)."""
    ref = model.clone()
    for site in graph.find_linears(ref):
        w_nk = site.read_nk()
        new = np.asarray(nk_of(site, w_nk), np.float32)
        stored = new if site.transpose is not None else np.ascontiguousarray(new.T)
        site.weight_value.const_value = ir.tensor(stored, name=site.weight_value.name)
    return ref


def _ops(model):
    return [n.op_type for n in model.graph]


def _int8_deq(w: np.ndarray, group: int) -> np.ndarray:
    k = w.shape[1]
    padded = np.pad(w, ((0, 0), (0, -k % group)))
    return int8.dequantize(*int8.quantize(padded, group))[:, :k]


@pytest.mark.parametrize("group,symmetric,embeddings,lm_head", [
    (32, False, "int8", "int8"), (64, True, "int4", "int4"), (128, False, "none", "none"), (128, True, "none", "int8")])
def test_int4_graph_matches_numpy_dequantized_weights(traced, group, symmetric, embeddings, lm_head):
    model, feeds, pool = traced
    q = model.clone()
    # MatMulNBits at accuracy level 0 computes in fp32: the graph's weights are checked exactly. llmc's own
    # kernel (int8 activations) is checked against it below.
    recipe = QuantRecipe(quant="int4", group_size=group, symmetric=symmetric, embeddings=embeddings, lm_head=lm_head,
                         int4_kernel="mlas")
    head = graph.lm_head_site(model, graph.find_linears(model)).weight_value.name
    stats = graph.quantize_model(q, recipe, None)
    n_int4 = len(graph.find_linears(model)) - (lm_head != "int4")
    assert stats["matches"] == n_int4 == stats["rtn"] and stats.get("lm_head_int8", 0) == (lm_head == "int8")
    # No float matmul weights left but the output projection when it is kept unquantized.
    assert [s.weight_value.name for s in graph.find_linears(q)] == ([head] if lm_head == "none" else [])
    assert _ops(q).count("MatMulNBits") == n_int4 + (lm_head == "int8")

    def reference(site, w):
        if site.weight_value.name == head and lm_head != "int4":
            return _int8_deq(w, group) if lm_head == "int8" else w
        return int4.quantize_rtn(w, group, symmetric).dequantize()

    ref = _with_weights(model, reference)
    if embeddings != "none":
        assert _ops(q).count("GatherBlockQuantized") == 1 and stats["embeddings"] == 1
        table = ref.graph.initializers["model.embed_tokens.weight"]
        t = table.const_value.numpy()
        deq = (int8.dequantize(*int8.quantize(t, group)) if embeddings == "int8"
               else int4.quantize_rtn(t, group, symmetric).dequantize())
        table.const_value = ir.tensor(deq, name=table.name)
    out, expect = run_graph(q, feeds, pool), run_graph(ref, feeds, pool)
    assert _rel(out, expect) < 2e-5
    assert _rel(out, run_graph(model, feeds, pool)) > 1e-4  # and it did quantize


@pytest.mark.parametrize("group,symmetric", [(32, False), (64, True), (128, False)])
def test_int4_llmc_kernel_graph_matches_matmulnbits_int8_compute(traced, group, symmetric):
    """The default CPU form (llmc.Int4MatMul) against MatMulNBits at accuracy level 4, which also rounds
    each activation group to int8 with scale max|x| / 127: the same arithmetic, so the logits agree to
    float rounding; and against the fp32-compute graph, up to that activation rounding (the random tiny
    model has flat, large activations: 2.5-3% of the logits)."""
    model, feeds, pool = traced
    base = dict(quant="int4", group_size=group, symmetric=symmetric, embeddings="none", lm_head="int4")
    ours, mlas4, mlas0 = model.clone(), model.clone(), model.clone()
    stats = graph.quantize_model(ours, QuantRecipe(**base), None)
    graph.quantize_model(mlas4, QuantRecipe(**base, int4_kernel="mlas"), None, accuracy_level=4)
    graph.quantize_model(mlas0, QuantRecipe(**base, int4_kernel="mlas"), None, accuracy_level=0)
    ops = _ops(ours)
    assert ops.count("Int4MatMul") == stats["matches"] == stats["int4_llmc_kernel"] > 0 and "MatMulNBits" not in ops
    out = run_graph(ours, feeds, pool)
    assert _rel(out, run_graph(mlas4, feeds, pool)) < 2e-5
    assert 1e-5 < _rel(out, run_graph(mlas0, feeds, pool)) < 5e-2  # random weights: 2.5-3% measured


def test_int4_swiglu_epilogue_fusion_keeps_the_logits(traced):
    """The backend's int4-swiglu fusion (gate/up tiles reordered, SwiGLU in the kernel's epilogue) against the
    same quantized graph lowered without it (Split + QuickGelu + Mul): one node per MLP instead of four, and the
    same logits to float rounding (the epilogue's sigmoid and ORT's QuickGelu differ in the last bits)."""
    from llmc.compiler.backends import onnxruntime as ort_backend

    model, feeds, pool = traced
    q = model.clone()
    graph.quantize_model(q, QuantRecipe(quant="int4", group_size=32, embeddings="none", lm_head="int4"), None)
    lowered = q.clone()
    stats = ort_backend.lower(lowered, "native")
    mlps = _ops(q).count("SwiGLU")
    assert stats["int4-swiglu"] == mlps > 0 and "QuickGelu" not in _ops(lowered) and "SwiGLU" not in _ops(lowered)
    fused = run_graph(q, feeds, pool)
    plain = run_graph(q, feeds, pool, fusions=frozenset({"rotary-attention"}))
    assert _rel(fused, plain) < 1e-5
    assert _rel(plain, run_graph(model, feeds, pool)) > 1e-4  # (the comparison is between quantized graphs)


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_qdq_form_computes_what_the_cpu_form_computes(traced, symmetric):
    """The explicit block-wise Q/DQ form (for TensorRT) and MatMulNBits (CPU) run the same weights."""
    model, feeds, pool = traced
    recipe = QuantRecipe(quant="int4", group_size=32, symmetric=symmetric, embeddings="none", lm_head="int4",
                         int4_kernel="mlas")
    cpu, qdq = model.clone(), model.clone()
    graph.quantize_model(cpu, recipe, None)
    stats = graph.quantize_model(qdq, recipe, None, form="qdq")
    ops = _ops(qdq)
    assert "MatMulNBits" not in ops and ops.count("DequantizeLinear") == stats["matches"] > 0
    dq = next(n for n in qdq.graph if n.op_type == "DequantizeLinear")
    assert dq.inputs[0].const_value.dtype == (ir.DataType.INT4 if symmetric else ir.DataType.UINT4)
    assert dq.attributes["block_size"].value == 32 and dq.attributes["axis"].value == 0
    assert _rel(run_graph(qdq, feeds, pool), run_graph(cpu, feeds, pool)) < 2e-5


def test_fp8_and_nvfp4_weight_graphs_match_numpy_dequantized_weights(traced):
    model, feeds, pool = traced
    for quant, deq in [("fp8", lambda s, w: fp8.quantize(w, axis=0).dequantize()),
                       ("nvfp4", lambda s, w: nvfp4.quantize(w).dequantize())]:
        q = model.clone()
        stats = graph.quantize_model(q, QuantRecipe(quant=quant), None)  # no calibration: weights only
        assert stats["matches"] == len(graph.find_linears(model)) and not graph.find_linears(q)
        out, expect = run_graph(q, feeds, pool), run_graph(_with_weights(model, deq), feeds, pool)
        assert _rel(out, expect) < 2e-5, quant


def _session(build):
    import onnxruntime as ort

    g = ir.Graph([], [], nodes=[], opset_imports={"": 23}, name="g")
    x = ir.Value(name="x", shape=ir.Shape([None, None]), type=ir.TensorType(ir.DataType.FLOAT))
    g.inputs.append(x)
    b = graph._Builder(g)
    nodes, out = build(b, x)
    g.extend(nodes)
    out.name = "y"
    g.outputs.append(out)
    model = ir.Model(g, ir_version=11)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def test_activation_qdq_subgraphs_match_the_codecs_bit_for_bit():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((37, 64)) * np.exp2(rng.uniform(-6, 3, (37, 4))).repeat(16, axis=1)).astype(np.float32)
    x[3, :16] = 0.0  # an all-zero block
    amax = float(np.abs(x).max())
    g = float(nvfp4.global_scale_for(amax * 0.5))  # a calibrated range smaller than this input: block scales saturate
    sess = _session(lambda b, v: graph.nvfp4_qdq(b, v, 64, g, "act"))
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], nvfp4.quantize(x, global_scale=g).dequantize())
    s = float(fp8.scale_for(amax * 0.5))  # saturating: values beyond the calibrated range clip to ±448·s
    sess = _session(lambda b, v: graph.fp8_qdq(b, v, s, "act"))
    expect = E4M3.decode(fp8.quantize_with_scale(x, s)) * np.float32(s)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], expect)
    assert np.abs(expect).max() == pytest.approx(448 * s)


def _split_sizes(site):
    (user, _), = site.node.outputs[0].uses()
    return [int(v) for v in user.inputs[1].const_value.numpy()] if user.op_type == "Split" else [site.n]


def test_awq_scales_fold_into_norms_or_an_explicit_mul(traced):
    """Fake AWQ results (random input scales, RTN of the scaled weights): the graph must divide the
    RMSNorm weights (Q/K/V, gate/up, LM head) or insert a Mul (o_proj) so that the network computes
    ``x/s @ Q(W·s)``, which equals the original graph with weights ``deq(Q(W·s)) / s``."""
    model, feeds, pool = traced
    rng = np.random.default_rng(5)
    calib = CalibrationResult()
    expect_w = {}
    for site in graph.find_linears(model):
        w = site.read_nk()
        s = np.exp(rng.uniform(-0.7, 0.7, site.k)).astype(np.float32)
        layer = site.members[0].rsplit(".", 3)[0]
        fold = {"q_proj": f"{layer}.input_layernorm.weight", "gate_proj": f"{layer}.post_attention_layernorm.weight",
                "o_proj": None}.get(site.members[0].split(".")[-2], "model.norm.weight")
        if ".down_proj." in site.members[0]:
            s = None  # its scale would fold into up_proj's rows, which is collect()'s job
        start = 0
        for name, rows in zip(site.members, _split_sizes(site), strict=True):
            part = w[start : start + rows]
            start += rows
            scaled = part if s is None else part * s
            q = int4.quantize_rtn(scaled, 64)
            calib.linears[name] = LinearQuant(q, s, fold if s is not None else None)
        expect_w[site.weight_value.name] = np.concatenate(
            [calib.linears[m].weights.dequantize() for m in site.members]) / (1 if s is None else s)
    q = model.clone()
    stats = graph.quantize_model(q, QuantRecipe(quant="int4-awq", group_size=64, embeddings="none", int4_kernel="mlas",
                                                         lm_head="int4"), calib)
    assert stats["calibrated"] == stats["matches"] and stats.get("rtn", 0) == 0
    assert stats["awq_folded_norms"] == 2 * 2 + 1 and stats["awq_mul"] == 2
    ref = _with_weights(model, lambda site, w: expect_w[site.weight_value.name])
    assert _rel(run_graph(q, feeds, pool), run_graph(ref, feeds, pool)) < 2e-5


def test_fp8_kv_cache_inserts_qdq_before_every_paged_attention(traced):
    model, feeds, pool = traced
    q = model.clone()
    layers = [n.attributes["layer_idx"].value for n in q.graph if n.op_type == "PagedAttention"]
    calib = CalibrationResult(kv_amax={i: (40.0 + i, 30.0) for i in layers})  # above the random K/V: no clipping
    stats = graph.quantize_model(q, QuantRecipe(kv_cache_dtype="fp8"), calib)
    assert stats["kv_fp8_layers"] == len(layers)
    for node in q.graph:
        if node.op_type == "PagedAttention":
            for slot in (1, 2):
                dq = node.inputs[slot].producer()
                assert dq.op_type == "DequantizeLinear" and dq.inputs[0].producer().op_type == "QuantizeLinear"
                assert dq.inputs[2].const_value.dtype == ir.DataType.FLOAT8E4M3FN  # the E4M3 zero point
    out, ref = run_graph(q, feeds, pool), run_graph(model, feeds, pool)
    assert 1e-5 < _rel(out, ref) < 0.1


def test_members_of_parses_packed_and_transposed_names():
    assert graph.members_of("packed[a.q.weight.T+a.k.weight.T]") == ["a.q.weight", "a.k.weight"]
    assert graph.members_of("m.o_proj.weight.T") == ["m.o_proj.weight"]
    assert graph.members_of("lm_head.weight") == ["lm_head.weight"]
    assert ml_dtypes.float8_e4m3fn  # the graph stores FP8 through ml_dtypes


def test_weights_are_read_through_the_layout_passes_not_transposed_back(traced):
    """A linear's [N, K] weight read from the nn.Linear parameters behind the lazy transpose / packing
    equals the stored [K, N] weight transposed, and the packed Q/K/V and gate/up sites do read that way."""
    from llmc.passes.lazy import derivation_of

    model, _, _ = traced
    sites = graph.find_linears(model)
    through = 0
    for site in sites:
        stored = np.asarray(site.tensor.numpy(), np.float32)
        expect = stored if site.transpose is not None else stored.T
        got = site.read_nk()
        assert got.flags.writeable and got.flags.c_contiguous
        np.testing.assert_array_equal(got, expect)
        made = derivation_of(site.tensor)
        through += made is not None and made.op == "concat"
    assert through >= 2 * 2  # tiny_llama: 2 layers x (packed QKV, packed gate/up)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float64])
def test_transpose_array_moves_any_dtype_exactly(dtype):
    from llmc.passes.lazy import transpose_array

    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, 320, 257)).astype(dtype)
    a.setflags(write=False)  # as a checkpoint's memory map: read without a warning on stderr
    for perm in [(0, 2, 1), (2, 0, 1)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = transpose_array(a, perm)
        assert got.dtype == a.dtype and got.flags.c_contiguous
        np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(np.transpose(a, perm)).view(np.uint8))
