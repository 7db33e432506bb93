"""llmc's MXFP4 expert matmul for the CPU: ``llmc.Mxfp4MoEMatMul`` in the native ONNX Runtime custom-op library
(csrc/mxfp4_core.h, its ONNX Runtime op csrc/ort_mxfp4.cpp), and its numpy reference.

gpt-oss ships its MoE experts as MXFP4 (OpenAI's layout: E2M1 codes two per byte, low nibble first, 32 along the
input dimension per block, one E8M0 exponent per block); the op multiplies each token row by its expert's weight
straight from those codes, so the engine keeps the experts at 4.25 bits per weight. On the GPU: the grouped Triton
kernel of :mod:`.triton_kernel` (its AOT requests: :mod:`.requests`)."""

OP_TYPE = "Mxfp4MoEMatMul"
# The opt-in 8-bit-activation variant (``llmc build --mxfp4-activations int8``; csrc/mxfp4_q8_core.h).
Q8_OP_TYPE = "Mxfp4MoEMatMulQ8"


def single_op_model(blocks, scales, **epilogue) -> bytes:
    """An ONNX model of the op alone, ``Y[S, 1, N] = Mxfp4MoEMatMul(X[S, 1, K], ids[S])`` with ``blocks``
    (uint8 [E, N, K/32, 16]) and ``scales`` (uint8 [E, N, K/32]) as initializers, and the optional epilogue
    (:func:`_model`): for the op's tests and benchmark. onnx is imported here, not with the package (the runtime
    does not need it)."""
    n = blocks.shape[1]
    return _model(OP_TYPE, "blocks", blocks, scales, 32 * blocks.shape[2], n, {}, **epilogue)


def single_op_model_q8(codes, scales, n: int, **epilogue) -> bytes:
    """An ONNX model of ``Mxfp4MoEMatMulQ8`` alone with the repacked ``codes`` and ``scales``
    (reference.repack_q8) as initializers, and the optional epilogue (:func:`_model`):
    ``Y[S / combine, 1, N or N/2] = op(X[S / x_share, 1, K], ids[S])``."""
    return _model(Q8_OP_TYPE, "codes", codes, scales, 32 * codes.shape[2], n, {"N": n}, **epilogue)


def _model(op_type: str, weight: str, codes, scales, k: int, n: int, attrs: dict, bias=None, activation: int = 0,
           alpha: float = 1.702, limit: float = 7.0, x_share: int = 1, combine: int = 1) -> bytes:
    """One expert op with its weights (and the epilogue's ``bias`` float32 [E, N]) as initializers; ``activation``
    1: gpt-oss's clamped SwiGLU; ``x_share`` / ``combine``: the top-k repeat and weighted sum (then a graph input
    ``weights [S]``)."""
    from onnx import TensorProto, helper, numpy_helper

    inputs, inits = ["X", "ids", weight, "scales"], [numpy_helper.from_array(codes, weight),
                                                     numpy_helper.from_array(scales, "scales")]
    if bias is not None:
        inputs.append("bias")
        inits.append(numpy_helper.from_array(bias, "bias"))
    attrs = {**attrs, **({"activation": activation, "alpha": alpha, "limit": limit} if activation else {})}
    attrs.update({"x_share": x_share} if x_share > 1 else {}, **({"combine": combine} if combine > 1 else {}))
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["R", 1, k]),
                    helper.make_tensor_value_info("ids", TensorProto.INT64, ["S"])]
    if combine > 1:
        inputs += [""] * (bias is None) + ["weights"]
        graph_inputs.append(helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["S"]))
    node = helper.make_node(op_type, inputs, ["Y"], domain="llmc", **attrs)
    graph = helper.make_graph(
        [node], op_type, graph_inputs,
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", 1, n // 2 if activation else n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("llmc", 1)]).SerializeToString()
