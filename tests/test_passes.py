"""Each pass on small hand-built graphs: fires where the pattern is exact (numerics unchanged), and
does not fire on near-misses. Graphs run in ONNX Runtime before and after (llmc ops lowered)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.backends import onnxruntime as ort_backend
from llmc.passes import activation, attention_layout, cleanup, normalization, projections, rotary, weight_layout
from llmc.passes.base import count_nodes

F = TensorProto.FLOAT
RNG = np.random.default_rng()


def _model(nodes, inputs, outputs, initializers=()) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    proto = onnx.shape_inference.infer_shapes(proto)
    return ir.serde.deserialize_model(proto)


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    ort_backend.lower(copy)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(ir.serde.serialize_model(copy).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check(model: ir.Model, run_pass, feeds, expect_matches: int, rtol=1e-5):
    before = _run(model, feeds)
    stats = run_pass(model)
    after = _run(model, feeds)
    assert stats["matches"] == expect_matches, stats
    for a, b in zip(after, before, strict=True):
        assert np.abs(a - b).max() <= rtol * np.abs(b).max(), np.abs(a - b).max()
    return model


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def _w(name, *shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# -- RMSNorm --------------------------------------------------------------------------------------------

def _rms_nodes(x="x", out="y", eps_after_sqrt=False, subtract_mean=False, scale="w"):
    nodes = []
    src = x
    if subtract_mean:
        nodes += [helper.make_node("ReduceMean", [x, "axes"], ["mu"], keepdims=1),
                  helper.make_node("Sub", [x, "mu"], ["xc"])]
        src = "xc"
    nodes += [helper.make_node("Pow", [src, "two"], ["sq"]),
              helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1, noop_with_empty_axes=0)]
    if eps_after_sqrt:
        nodes += [helper.make_node("Sqrt", ["ms"], ["rt"]), helper.make_node("Add", ["rt", "eps"], ["den"])]
    else:
        nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["den"])]
    nodes += [helper.make_node("Reciprocal", ["den"], ["inv"]),
              helper.make_node("Mul", [src, "inv"], ["nrm"]),
              helper.make_node("Mul", ["nrm", scale], [out])]
    return nodes


def _rms_model(**kw):
    return _model(_rms_nodes(**kw), [helper.make_tensor_value_info("x", F, [2, 5, 16])],
                  [helper.make_tensor_value_info("y", F, [2, 5, 16])],
                  [_w("w", 16), numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                   numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
                   numpy_helper.from_array(np.array([-1], np.int64), "axes")])


def test_rms_norm_fires_and_is_exact():
    m = _check(_rms_model(), normalization.rms_norm, {"x": _x(2, 5, 16)}, 1)
    assert "RMSNormalization" in _ops(m)


def test_rms_norm_not_on_epsilon_after_sqrt():
    """x / (sqrt(mean(x²)) + eps) is a different function from RMSNorm."""
    m = _check(_rms_model(eps_after_sqrt=True), normalization.rms_norm, {"x": _x(2, 5, 16)}, 0)
    assert "RMSNormalization" not in _ops(m)


def test_layer_norm_keeps_its_mean_subtraction():
    """LayerNorm without bias is RMSNorm of the *centred* input: the pass may fuse only that part,
    so the mean subtraction must survive and the numerics stay exact."""
    m = _check(_rms_model(subtract_mean=True), normalization.rms_norm, {"x": _x(2, 5, 16)}, 1)
    ops = _ops(m)
    assert "Sub" in ops and "ReduceMean" in ops
    norm = next(n for n in m.graph if n.op_type == "RMSNormalization")
    assert norm.inputs[0].producer().op_type == "Sub"


# -- residual add + RMSNorm ---------------------------------------------------------------------------

def _skip_model(b_shape, a_shape=(1, 6, 16)):
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("RMSNormalization", ["s", "w"], ["y"], epsilon=1e-5, axis=-1),
             helper.make_node("Mul", ["s", "y"], ["z"])]  # the sum is also used: the next residual
    return _model(nodes, [helper.make_tensor_value_info("a", F, list(a_shape)),
                          helper.make_tensor_value_info("b", F, b_shape)],
                  [helper.make_tensor_value_info("z", F, list(a_shape))], [_w("w", a_shape[-1])])


def test_skip_rms_norm_fires_and_is_exact():
    m = _check(_skip_model([1, 6, 16]), normalization.skip_rms_norm, {"a": _x(1, 6, 16), "b": _x(1, 6, 16)}, 1)
    assert _ops(m).count("SkipRMSNormalization") == 1 and "Add" not in _ops(m)


def test_skip_rms_norm_over_per_head_4d_tensors_runs_on_onnx_runtime():
    """HunYuan normalizes rotated queries and keys ([batch, heads, tokens, head size]; rotary ends in an Add):
    ONNX Runtime's SkipSimplifiedLayerNormalization takes 2-D or 3-D input only, so the backend lowers this one
    as Add + RMSNormalization."""
    shape = (1, 4, 6, 16)
    m = _check(_skip_model(list(shape), shape), normalization.skip_rms_norm, {"a": _x(*shape), "b": _x(*shape)}, 1)
    lowered = ir.serde.deserialize_model(ir.serde.serialize_model(m))
    ort_backend.lower(lowered)
    assert "SkipSimplifiedLayerNormalization" not in _ops(lowered) and "RMSNormalization" in _ops(lowered)


def test_skip_rms_norm_not_on_broadcast_add():
    """A bias add (broadcast) before the norm is not a residual connection."""
    m = _check(_skip_model([16]), normalization.skip_rms_norm, {"a": _x(1, 6, 16), "b": _x(16)}, 0)
    assert "SkipRMSNormalization" not in _ops(m)


# -- packed projections ---------------------------------------------------------------------------------

def _proj_model(share_weight=False, dynamic_weight=False):
    inits = [_w("wq", 16, 16), _w("wk", 16, 8), _w("wv", 16, 8)]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]),
             helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv" if not dynamic_weight else "wdyn"], ["v"])]
    outs = ["q", "k", "v"]
    inputs = [helper.make_tensor_value_info("x", F, [3, 16])]
    if dynamic_weight:
        inputs.append(helper.make_tensor_value_info("wdyn", F, [16, 8]))
    if share_weight:  # wk also feeds another computation, as a tied weight would
        nodes.append(helper.make_node("ReduceSum", ["wk"], ["wk_sum"], keepdims=0))
        outs.append("wk_sum")
    return _model(nodes, inputs, [helper.make_tensor_value_info(o, F, None) for o in outs], inits)


def test_pack_projections_fires_and_is_exact():
    m = _check(_proj_model(), projections.pack_projections, {"x": _x(3, 16)}, 1)
    assert _ops(m).count("MatMul") == 1 and "Split" in _ops(m)


def test_pack_projections_skips_shared_and_dynamic_weights():
    m = _check(_proj_model(share_weight=True), projections.pack_projections, {"x": _x(3, 16)}, 1)
    assert _ops(m).count("MatMul") == 2  # q and v packed; k, whose weight is shared, left alone
    m = _check(_proj_model(dynamic_weight=True), projections.pack_projections,
               {"x": _x(3, 16), "wdyn": _x(16, 8)}, 1)
    assert _ops(m).count("MatMul") == 2  # the activation-valued projection is not packed


def test_pack_projections_needs_two():
    inits = [_w("wq", 16, 16)]
    m = _model([helper.make_node("MatMul", ["x", "wq"], ["q"])], [helper.make_tensor_value_info("x", F, [3, 16])],
               [helper.make_tensor_value_info("q", F, None)], inits)
    _check(m, projections.pack_projections, {"x": _x(3, 16)}, 0)


# -- weight layout -----------------------------------------------------------------------------------------

def test_weight_layout_folds_private_transposes_only():
    nodes = [helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w1t"], ["y1"]),
             helper.make_node("Transpose", ["w2"], ["w2t"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "w2t"], ["y2"]),
             helper.make_node("ReduceSum", ["w2"], ["w2s"], keepdims=0)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [3, 16])],
               [helper.make_tensor_value_info(o, F, None) for o in ("y1", "y2", "w2s")],
               [_w("w1", 8, 16), _w("w2", 8, 16)])
    m = _check(m, weight_layout.transpose_weights, {"x": _x(3, 16)}, 1)
    assert _ops(m).count("Transpose") == 1  # w2 is used elsewhere: its transpose stays


# -- SwiGLU ------------------------------------------------------------------------------------------------

def _glu_model(gate_of_other=False):
    nodes = [helper.make_node("Sigmoid", ["g" if not gate_of_other else "u"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["silu"]),
             helper.make_node("Mul", ["silu", "u"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("g", F, [3, 8]), helper.make_tensor_value_info("u", F, [3, 8])],
                  [helper.make_tensor_value_info("y", F, [3, 8])])


def test_swiglu_fires_and_is_exact():
    m = _check(_glu_model(), activation.swiglu, {"g": _x(3, 8), "u": _x(3, 8)}, 1)
    assert _ops(m) == ["SwiGLU"]


def test_swiglu_not_on_cross_gating():
    """g * sigmoid(u) * u is not SiLU(g) * u."""
    _check(_glu_model(gate_of_other=True), activation.swiglu, {"g": _x(3, 8), "u": _x(3, 8)}, 0)


# -- rotary embedding ----------------------------------------------------------------------------------------

def _rotary_model(split_at):
    d = 16
    c = lambda name, vals: helper.make_node("Constant", [], [name], value_ints=vals)  # noqa: E731
    nodes = [c("s1", [0]), c("e1", [split_at]), c("s2", [split_at]), c("e2", [2**62]), c("ax", [3]), c("st", [1]),
             c("one", [1]),
             helper.make_node("Concat", ["freqs", "freqs"], ["f2"], axis=-1),
             helper.make_node("Cos", ["f2"], ["cos"]), helper.make_node("Sin", ["f2"], ["sin"]),
             helper.make_node("Unsqueeze", ["cos", "one"], ["cos4"]),
             helper.make_node("Unsqueeze", ["sin", "one"], ["sin4"]),
             helper.make_node("Slice", ["x", "s1", "e1", "ax", "st"], ["x1"]),
             helper.make_node("Slice", ["x", "s2", "e2", "ax", "st"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["nx2"]),
             helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos4"], ["a"]), helper.make_node("Mul", ["rot", "sin4"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", F, [1, 2, 5, d]),
                          helper.make_tensor_value_info("freqs", F, [1, 5, d // 2])],
                  [helper.make_tensor_value_info("y", F, [1, 2, 5, d])])


def test_rotary_fires_and_is_exact():
    feeds = {"x": _x(1, 2, 5, 16), "freqs": _x(1, 5, 8)}
    m = _check(_rotary_model(8), rotary.rotary_embedding, feeds, 1)
    assert "RotaryEmbedding" in _ops(m)


def test_rotary_not_on_uneven_split():
    feeds = {"x": _x(1, 2, 5, 16), "freqs": _x(1, 5, 8)}
    # Splitting at 6 of 16 changes shapes, so build a consistent graph: halves of 6 and 10 do not concat back to
    # a rotation; the rule must refuse it.
    model = _rotary_model(8)
    for node in model.graph:
        if node.op_type == "Constant" and node.outputs[0].name in ("e1", "s2"):
            node.attributes["value_ints"] = ir.AttrInt64s("value_ints", [6])
    _check(model, rotary.rotary_embedding, feeds, 0)


# -- head layout around attention ------------------------------------------------------------------------

def _head_layout_model(batch=1, index=0, rotary_perm=(0, 2, 1, 3), index_input=False):
    """Q [B, T, H*D] -> Reshape [B, T, H, D] -> Transpose -> RotaryEmbedding -> Gather(index) -> Transpose
    -> Reshape [T, H*D], as torch exports it, and the same chain without the rotary (V)."""
    t, h, d = 5, 3, 8
    shape = lambda name, vals: numpy_helper.from_array(np.asarray(vals, np.int64), name)  # noqa: E731
    inits = [shape("split", [batch, t, h, d]), shape("flat", [t, h * d]),
             numpy_helper.from_array(np.asarray(index, np.int64), "idx")]
    nodes = []
    for x, rot in (("q", True), ("v", False)):
        nodes += [helper.make_node("Reshape", [x, "split"], [f"{x}4"]),
                  helper.make_node("Transpose", [f"{x}4"], [f"{x}t"], perm=list(rotary_perm))]
        src = f"{x}t"
        if rot:
            nodes.append(helper.make_node("RotaryEmbedding", [src, "cos", "sin"], [f"{x}r"], num_heads=h))
            src = f"{x}r"
        nodes += [helper.make_node("Gather", [src, "index" if index_input else "idx"], [f"{x}g"], axis=0),
                  helper.make_node("Transpose", [f"{x}g"], [f"{x}tt"], perm=[1, 0, 2]),
                  helper.make_node("Reshape", [f"{x}tt", "flat"], [f"{x}_out"])]
    inputs = [helper.make_tensor_value_info(n, F, [batch, t, h * d]) for n in ("q", "v")]
    inputs += [helper.make_tensor_value_info(n, F, [batch, t, d // 2]) for n in ("cos", "sin")]
    if index_input:
        inputs.append(helper.make_tensor_value_info("index", TensorProto.INT64, []))
    outputs = [helper.make_tensor_value_info(f"{x}_out", F, [t, h * d]) for x in ("q", "v")]
    return _model(nodes, inputs, outputs, inits)


def _head_layout_feeds(batch=1, index_input=False):
    angles = RNG.uniform(0, 6.3, (batch, 5, 4)).astype(np.float32)
    feeds = {"q": _x(batch, 5, 24), "v": _x(batch, 5, 24), "cos": np.cos(angles), "sin": np.sin(angles)}
    if index_input:
        feeds["index"] = np.asarray(0, np.int64)
    return feeds


def test_head_layout_fires_and_is_exact():
    m = _check(_head_layout_model(), attention_layout.fold_head_layout, _head_layout_feeds(), 2)
    assert sorted(_ops(m)) == ["Reshape", "Reshape", "RotaryEmbedding"]
    rotary_node = next(n for n in m.graph if n.op_type == "RotaryEmbedding")
    assert rotary_node.inputs[0].name == "q" and rotary_node.attributes["num_heads"].value == 3
    assert [v.name for v in m.graph.outputs] == ["q_out", "v_out"]


def test_head_layout_not_on_other_rows_or_layouts():
    # A batch of 2 (the Gather picks one sequence out of two): not a pure reshape.
    _check(_head_layout_model(batch=2, index=1), attention_layout.fold_head_layout, _head_layout_feeds(2), 0)
    # An index only known at run time.
    _check(_head_layout_model(index_input=True), attention_layout.fold_head_layout,
           _head_layout_feeds(index_input=True), 0)


def test_head_layout_on_a_traced_llama(tiny_engine):
    """On a real build (every pass verified against ONNX Runtime by the fixture), Q, K and V of every
    layer reach attention through one Reshape, and no Transpose is left before attention."""
    import json

    report = json.loads((tiny_engine / "report.json").read_text())
    stats = next(p for p in report["passes"] if p["pass"] == "head-layout")
    layers = json.loads((tiny_engine / "manifest.json").read_text())["kv_cache"]["num_layers"]
    assert stats["matches"] == 3 * layers and stats["packed_rotaries"] == 2 * layers
    assert stats["verified_rel_error"] is not None and stats["verified_rel_error"] <= 1e-5
    graph = onnx.load(tiny_engine / "model.onnx", load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    for node in graph.node:
        if node.op_type == "PagedAttention":
            for name in node.input[:3]:
                assert producer[name].op_type == "Reshape", producer[name]
                assert producer[producer[name].input[0]].op_type in ("Split", "RotaryEmbedding")


# -- cleanup ----------------------------------------------------------------------------------------------

def test_fold_constants_and_dce_keep_numerics():
    nodes = [helper.make_node("Constant", [], ["c"], value_float=3.0),
             helper.make_node("Mul", ["c", "c"], ["c2"]),
             helper.make_node("Mul", ["x", "c2"], ["y"]),
             helper.make_node("Neg", ["x"], ["unused"])]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, [4])], [helper.make_tensor_value_info("y", F, [4])])
    before = count_nodes(m)
    _check(m, cleanup.fold_constants, {"x": _x(4)}, before - 1)
    assert _ops(m) == ["Mul"]


# -- differential verification of a whole build ------------------------------------------------------------

def test_verify_passes_names_a_broken_pass(tmp_path, tiny_llama):
    """A test-only pass that perturbs one weight is caught by --verify-passes, by name."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.errors import LlmcError
    from llmc.passes.base import GraphPass

    def perturb(model: ir.Model) -> dict[str, int]:
        name = next(n for n in model.graph.initializers if "down_proj" in n)
        value = model.graph.initializers[name]
        value.const_value = ir.tensor(value.const_value.numpy() * 1.01, name=name)
        return {"matches": 1}

    broken = GraphPass("test-only-scale-down-proj", perturb, "breaks numerics on purpose")
    with pytest.raises(LlmcError) as err:
        build(tiny_llama, tmp_path / "e", BuildOptions(verify_passes=True, extra_passes=(broken,)))
    assert "test-only-scale-down-proj" in str(err.value) and "relative error" in str(err.value)
    assert not (tmp_path / "e").exists()
