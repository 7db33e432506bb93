"""The ONNX Runtime backend keeps bfloat16 weights in bfloat16 (passes/ort/bf16_weights.py).

A checkpoint stored in bfloat16 gives an engine whose linears are ``llmc.Bf16MatMul`` over the weights as stored
(half the bytes of float32), with the same greedy tokens as transformers in float32; a float32 checkpoint's weights
stay float32; ``--disable-pass bf16-weights`` turns it off. On a hand-made graph: a weight of unknown provenance is
lowered only if its values are bfloat16, one stored otherwise is never read, a weight another node also reads
stays, and the lowered graph computes what the float32 one did.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from llmc.passes.ort.bf16_weights import SOURCE_DTYPE, lower_bf16_weights
from llmc.runtime import Engine, SamplingParams
from llmc.testing.ort_sessions import native_session


def _ops(engine_dir) -> dict[str, int]:
    model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_bf16_checkpoint_keeps_its_weights_in_bf16(tiny_engine, tiny_engine_bf16):
    import json

    fp32_report = json.loads((tiny_engine / "report.json").read_text())
    bf16_report = json.loads((tiny_engine_bf16 / "report.json").read_text())
    ops32, ops16 = _ops(tiny_engine), _ops(tiny_engine_bf16)
    assert fp32_report["backend_fusions"]["bf16-weights"] == 0 and "Bf16MatMul" not in ops32
    lowered = bf16_report["backend_fusions"]["bf16-weights"]
    # every linear of the float32 engine (a MatMul there) is a Bf16MatMul here, and no MatMul is left
    assert lowered == ops16["Bf16MatMul"] == ops32["MatMul"] > 0 and "MatMul" not in ops16
    w32 = (tiny_engine / "model.onnx.data").stat().st_size
    w16 = (tiny_engine_bf16 / "model.onnx.data").stat().st_size
    assert w16 < 0.75 * w32  # the linears at 2 bytes a weight (the embedding stays float32)


def test_disabling_it_gives_the_same_numbers(tiny_llama_bf16, tiny_engine_bf16, tmp_path):
    from llmc.compiler.build import BuildOptions, build

    plain = tmp_path / "plain"
    result = build(tiny_llama_bf16, plain, BuildOptions(disabled_passes=("bf16-weights",)))
    assert result.report["backend_fusions"]["bf16-weights"] == 0 and "Bf16MatMul" not in _ops(plain)
    prompt = np.random.default_rng(4).integers(4, 500, 40).tolist()
    a, b = Engine.load(tiny_engine_bf16).score(prompt), Engine.load(plain).score(prompt)
    # the same products, summed in another order (ONNX Runtime's MLAS vs one chain along k)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert (Engine.load(tiny_engine_bf16).generate([prompt], params)[0].token_ids
            == Engine.load(plain).generate([prompt], params)[0].token_ids)


def _graph(weights: dict[str, ir.TensorProtocol], tied: str | None = None) -> ir.Model:
    """Y_name = X @ W_name for each weight, and (``tied``) a Gather that also reads that weight."""
    x = ir.Value(name="X", shape=ir.Shape(["S", 64]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes, outputs, inits = [], [], []
    for name, tensor in weights.items():
        w = ir.Value(name=name, shape=ir.Shape(list(tensor.shape)), type=ir.TensorType(ir.DataType.FLOAT))
        w.const_value = tensor
        inits.append(w)
        mm = ir.node("MatMul", [x, w])
        mm.outputs[0].name = f"Y_{name}"
        nodes.append(mm)
        outputs.append(mm.outputs[0])
        if name == tied:
            idx = ir.Value(name="idx", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.INT64))
            idx.const_value = ir.tensor(np.array([0, 3], np.int64), name="idx")
            inits.append(idx)
            gather = ir.node("Gather", [w, idx])
            gather.outputs[0].name = "G"
            nodes.append(gather)
            outputs.append(gather.outputs[0])
    graph = ir.Graph([x], outputs, nodes=nodes, initializers=inits, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


def _run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    return native_session(ir.serde.serialize_model(model).SerializeToString()).run(None, {"X": x})


def test_lowering_on_a_hand_made_graph():
    rng = np.random.default_rng(11)

    def bf16_values(shape):
        w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)

    def never_read():
        raise AssertionError("a weight the checkpoint stores as float16 was read to check it")

    stored_fp16 = ir.LazyTensor(never_read, dtype=ir.DataType.FLOAT, shape=ir.Shape([64, 32]), name="fp16")
    stored_fp16.meta[SOURCE_DTYPE] = "float16"
    stored_values = bf16_values((64, 50))
    stored_bf16 = ir.LazyTensor(lambda: ir.tensor(stored_values, name="stored"), dtype=ir.DataType.FLOAT,
                                shape=ir.Shape([64, 50]), name="stored")
    stored_bf16.meta[SOURCE_DTYPE] = "bfloat16"
    weights = {"exact": ir.tensor(bf16_values((64, 96)), name="exact"),
               "inexact": ir.tensor((rng.standard_normal((64, 40)) * 0.1).astype(np.float32), name="inexact"),
               "tied": ir.tensor(bf16_values((64, 16)), name="tied"), "fp16": stored_fp16, "stored": stored_bf16}
    x = rng.standard_normal((5, 64)).astype(np.float32)
    model = _graph({k: v for k, v in weights.items() if k != "fp16"}, tied="tied")
    before = _run(model, x)
    assert lower_bf16_weights(model) == 2  # exact, stored
    lowered = {n.inputs[1].name for n in model.graph if n.op_type == "Bf16MatMul"}
    assert lowered == {"exact.bf16", "stored.bf16"}
    assert "exact" not in model.graph.initializers and "tied" in model.graph.initializers
    after = _run(model, x)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    fp16_only = _graph({"fp16": stored_fp16})
    assert lower_bf16_weights(fp16_only) == 0  # without reading it (never_read would raise)
