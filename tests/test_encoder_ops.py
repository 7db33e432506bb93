"""The CUDA engine's ops that vision encoders need (Conv, AveragePool, Mod, integer Div, ReduceMax/Min, logical
ops, the fused EncoderAttention) against ONNX Runtime running the same ONNX node, and the encoders' Triton kernels
(LayerNorm, GELU) against the torch ops they replace, under the Triton interpreter, and compiled ahead of time.

Fresh random inputs every run; integer inputs include negatives (where truncating and flooring differ)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from llmc.plugins.fused import encoder_kernels as ek
from llmc.runtime.workers.cuda.ops import OPS

_TYPES = {np.float32: TensorProto.FLOAT, np.int64: TensorProto.INT64, np.bool_: TensorProto.BOOL}


def _ort(op: str, inputs: list[np.ndarray], consts: dict[str, np.ndarray] | None = None, **attrs) -> np.ndarray:
    """One ONNX node run by ONNX Runtime: ``inputs`` as graph inputs, ``consts`` as initializers after them."""
    consts = consts or {}
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, [*names, *consts], ["y"], **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, _TYPES[a.dtype.type], a.shape) for n, a in zip(names, inputs, strict=True)],
        [helper.make_tensor_value_info("y", _TYPES[inputs[0].dtype.type], None)],
        [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, dict(zip(names, inputs, strict=True)))[0]


def _ours(op: str, inputs: list, **attrs) -> np.ndarray:
    (y,) = OPS[op](*[torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in inputs], **attrs)
    return y.numpy()


def _ints(rng, *shape, lo=-50, hi=50):
    return rng.integers(lo, hi, shape).astype(np.int64)


def test_integer_div_truncates_and_mod_follows_onnx():
    rng = np.random.default_rng()
    a, b = _ints(rng, 40), _ints(rng, 40, lo=1, hi=9) * rng.choice([-1, 1], 40)
    np.testing.assert_array_equal(_ours("Div", [a, b]), _ort("Div", [a, b]))
    for fmod in (0, 1):
        np.testing.assert_array_equal(_ours("Mod", [a, b], fmod=fmod), _ort("Mod", [a, b], fmod=fmod))
    x, y = rng.standard_normal(30).astype(np.float32), rng.uniform(0.5, 3, 30).astype(np.float32)
    np.testing.assert_allclose(_ours("Div", [x, y]), _ort("Div", [x, y]), rtol=1e-6)
    np.testing.assert_allclose(_ours("Mod", [x, y], fmod=1), _ort("Mod", [x, y], fmod=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_max_and_min(op):
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    for axes, keep in (([1], 1), ([0, 2], 0), (None, 1)):
        consts = {} if axes is None else {"axes": np.array(axes, np.int64)}
        want = _ort(op, [x], consts, keepdims=keep)
        np.testing.assert_array_equal(_ours(op, [x, axes], keepdims=keep), want)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logical_ops(op):
    rng = np.random.default_rng()
    a, b = rng.random(20) > 0.5, rng.random(20) > 0.5
    np.testing.assert_array_equal(_ours(op, [a, b]), _ort(op, [a, b]))


@pytest.mark.parametrize("kernel,strides,pads", [((2, 2), (2, 2), (0, 0, 0, 0)), ((3, 3), (1, 2), (1, 1, 1, 1))])
def test_average_pool(kernel, strides, pads):
    x = np.random.default_rng().standard_normal((2, 4, 9, 10)).astype(np.float32)
    attrs = dict(kernel_shape=list(kernel), strides=list(strides), pads=list(pads))
    np.testing.assert_allclose(_ours("AveragePool", [x], **attrs), _ort("AveragePool", [x], **attrs),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["patch", "padded-asymmetric", "grouped", "3d"])
def test_conv(case):
    rng = np.random.default_rng()
    if case == "3d":  # Qwen's patch embedding: [B, 3, T, P, P] by a [D, 3, T, P, P] kernel
        x, w = rng.standard_normal((2, 3, 2, 8, 8)), rng.standard_normal((5, 3, 2, 4, 4))
        attrs = dict(strides=[2, 4, 4])
    elif case == "grouped":
        x, w = rng.standard_normal((1, 4, 7, 7)), rng.standard_normal((6, 2, 3, 3))
        attrs = dict(group=2, pads=[1, 1, 1, 1], dilations=[2, 1])
    elif case == "padded-asymmetric":
        x, w = rng.standard_normal((1, 3, 9, 11)), rng.standard_normal((4, 3, 3, 3))
        attrs = dict(pads=[0, 1, 2, 1], strides=[2, 1])
    else:
        x, w = rng.standard_normal((2, 3, 16, 16)), rng.standard_normal((8, 3, 4, 4))
        attrs = dict(strides=[4, 4])
    x, w = x.astype(np.float32), w.astype(np.float32)
    b = rng.standard_normal(w.shape[0]).astype(np.float32)
    want = _ort("Conv", [x], {"w": w, "b": b}, **attrs)
    np.testing.assert_allclose(_ours("Conv", [x, w, b], **attrs), want, rtol=1e-4, atol=1e-4)


def test_encoder_attention_is_the_unfused_softmax():
    rng = np.random.default_rng()
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 3, 17, 8)).astype(np.float32)) for _ in range(3))
    scale = float(rng.uniform(0.1, 0.5))
    want = torch.softmax(q @ k.transpose(-1, -2) * scale, -1) @ v
    (got,) = OPS["EncoderAttention"](q, k.transpose(-1, -2), v, scale=scale, key_transposed=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,bias", [(64, True), (200, False)])
def test_layer_norm_kernel_equals_the_torch_op(dtype, n, bias):
    rows = 7
    x = (torch.randn(1, rows, n) * 3 + 1).to(dtype)
    w, b = (torch.rand(n) + 0.5).to(dtype), torch.randn(n).to(dtype)
    out = torch.empty_like(x)
    ek.layer_norm_kernel[(rows,)](x, w, b if bias else w, out, rows, N=n, BLOCK=1 << (n - 1).bit_length(), EPS=1e-6,
                                  HAS_BIAS=bias)
    (want,) = OPS["LayerNormalization"](x, w, b if bias else None, epsilon=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_kernel_equals_the_torch_op(dtype, approximate):
    rows, n = 5, 1500
    x = (torch.randn(rows, n) * 4).to(dtype)
    out = torch.empty_like(x)
    ek.gelu_kernel[(rows, -(-n // 1024))](x, out, rows, N=n, BLOCK=1024, TANH=approximate == "tanh")
    (want,) = OPS["Gelu"](x, approximate=approximate)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


def test_encoder_kernels_compile_ahead_of_time():
    from llmc.plugins import triton_aot
    from llmc.plugins.fused import requests

    reqs = [requests.layer_norm_request(1152, 1e-6, True, "bf16", "bf16"), requests.gelu_request(4304, "tanh", "bf16")]
    for req, k in zip(reqs, triton_aot.compile_requests(reqs, 90), strict=True):
        entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
        assert entry.count(".param") == len([t for t in req["signature"].values() if t != "constexpr"])
        assert k["target"] == "sm_90a" and k["shared_mem"] <= 48 * 1024
