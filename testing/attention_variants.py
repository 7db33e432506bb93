"""Checks shared by the tests of PagedAttention's variants (attention sinks, ALiBi, chunked local attention,
bidirectional spans): each implementation of the op held to the numpy reference on the same random case.

A case is ``(inputs, caches, attrs)`` from :func:`llmc.testing.paged_attention.make_case` with the variant's
attributes added to ``attrs`` (``sinks`` [Hq] float32, ``alibi_max_bias``, ``attention_chunk``, ``sliding_window``,
``attend_end`` [T] int64: the ONNX ops take it as their optional input 8, a graph input named ``attend_end``).
Each ``check_*`` raises AssertionError on a difference beyond ``RTOL``/``ATOL`` (float32; the tests' docstrings
explain the tolerances) and returns the implementation's output.
"""

from __future__ import annotations

import numpy as np

RTOL, ATOL = 1e-4, 2e-5
ISAS = ["avx512", "avx2", "baseline"]


def run_reference(inputs: dict, caches: tuple, attrs: dict):
    """The numpy reference on copies of the caches: ``(out [T, Hq*D], (k_cache, v_cache) after the step)``."""
    from llmc.plugins.paged_attention import reference

    k, v = (c.copy() for c in caches)
    return reference.paged_attention(**inputs, k_cache=k, v_cache=v, **attrs), (k, v)


def check_cpu_kernel(inputs: dict, caches: tuple, attrs: dict, *, atol: float = ATOL) -> np.ndarray:
    """The C++ CPU kernel (whichever ISA is selected): the same cache rows written, the same output."""
    from llmc.plugins.paged_attention.cpu import paged_attention_cpu

    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    k, v = (c.copy() for c in caches)
    got = paged_attention_cpu(**inputs, k_cache=k, v_cache=v, **attrs)
    np.testing.assert_array_equal(k, k_ref)
    np.testing.assert_array_equal(v, v_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=atol)
    return got


def attention_graph(op: str, hq: int, hkv: int, d: int, node_attrs: dict, *, sinks: np.ndarray | None = None,
                    attend_end: bool = False, domain: str = "llmc") -> bytes:
    """A one-node ONNX model of ``op`` (``PagedAttention``, ``RotaryPagedAttention`` or the Python op's type), its
    sinks (when given) as the optional input after the step metadata, held as an initializer, then (``attend_end``)
    the graph input ``attend_end`` [T] int64: the llmc ops' input 8 (input 7 empty without sinks), the Python ops'
    last input (they have no optional inputs)."""
    from onnx import TensorProto, helper, numpy_helper

    from llmc.plugins.paged_attention import ATTEND_END_INPUT, INPUT_NAMES, SINKS_INPUT

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
    names = [*heads, *INPUT_NAMES[3:]] + ([SINKS_INPUT] if sinks is not None else [])
    if attend_end:
        names += [ATTEND_END_INPUT] if sinks is not None or domain != "llmc" else ["", ATTEND_END_INPUT]
        inputs.append(helper.make_tensor_value_info(ATTEND_END_INPUT, TensorProto.INT64, ["T"]))
    node = helper.make_node(op, names, ["out"], domain=domain, layer_idx=0, num_heads=hq, num_kv_heads=hkv,
                            head_size=d, **node_attrs)
    init = [numpy_helper.from_array(sinks, SINKS_INPUT)] if sinks is not None else []
    g = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("out", f, ["T", hq * d])],
                          initializer=init)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)])
    return m.SerializeToString()


def _feeds(inputs: dict, attrs: dict) -> dict:
    """A session's feeds: the step's inputs, and attend_end when the case has it (a graph input)."""
    return {**inputs, "attend_end": attrs["attend_end"]} if attrs.get("attend_end") is not None else inputs


def check_native_op(inputs: dict, caches: tuple, attrs: dict, node_attrs: dict, hq: int, hkv: int, d: int
                    ) -> np.ndarray:
    """llmc's native ``PagedAttention`` in ONNX Runtime, over a bound pool: the new K rows and the output."""
    from llmc.plugins.paged_attention import ort_native
    from llmc.testing.ort_sessions import native_session

    expected, (k_ref, _) = run_reference(inputs, caches, attrs)
    session = native_session(attention_graph("PagedAttention", hq, hkv, d, node_attrs, sinks=attrs.get("sinks"),
                                             attend_end=attrs.get("attend_end") is not None))
    pool = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, _feeds(inputs, attrs))
    np.testing.assert_array_equal(pool[0][0], k_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    return got


def check_native_rotary_op(inputs: dict, caches: tuple, attrs: dict, node_attrs: dict, hq: int, hkv: int, d: int,
                           seed: int = 5) -> np.ndarray:
    """The fused ``RotaryPagedAttention`` on a random packed QKV and random rotary angles, against
    ``reference.rotary_paged_attention``: the written K rows (rotated in float32) and the output."""
    from llmc.plugins.paged_attention import INPUT_NAMES, ort_native, reference
    from llmc.testing.ort_sessions import native_session

    rng = np.random.default_rng(seed)
    t = inputs["query"].shape[0]
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * d)).astype(np.float32)
    ang = rng.uniform(0, 6.3, (t, d // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    meta = {n: inputs[n] for n in INPUT_NAMES[3:]}
    k_ref, v_ref = (c.copy() for c in caches)
    expected = reference.rotary_paged_attention(qkv, cos, sin, *meta.values(), k_ref, v_ref, **attrs)
    session = native_session(attention_graph("RotaryPagedAttention", hq, hkv, d, node_attrs,
                                             sinks=attrs.get("sinks"), attend_end=attrs.get("attend_end") is not None))
    pool = [tuple(c.copy() for c in caches)]
    with ort_native.bound_pool(pool):
        (got,) = session.run(None, _feeds({"qkv": qkv, "cos": cos, "sin": sin, **meta}, attrs))
    np.testing.assert_allclose(pool[0][0], k_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    return got


def check_python_op(op_type: str, inputs: dict, caches: tuple, attrs: dict, node_attrs: dict, hq: int, hkv: int,
                    d: int) -> np.ndarray:
    """The Python ORT op (llmc.plugins.paged_attention.ort_op) of type ``op_type``."""
    import onnxruntime as ort

    from llmc.plugins.paged_attention import kv_binding, ort_op

    expected, _ = run_reference(inputs, caches, attrs)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(ort_op.library_path())
    model = attention_graph(op_type, hq, hkv, d, node_attrs, sinks=attrs.get("sinks"),
                            attend_end=attrs.get("attend_end") is not None, domain=ort_op.ORT_DOMAIN)
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    with kv_binding.bound_pool([tuple(c.copy() for c in caches)]):
        (got,) = session.run(None, _feeds(inputs, attrs))
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    return got


def check_torch_custom_op(inputs: dict, caches: tuple, attrs: dict, hq: int, hkv: int, d: int, *,
                          custom_op_tail: tuple) -> None:
    """The torch custom op the frontend traces (``torch.ops.llmc.paged_attention``; its positional arguments after
    the step's tensors: ``layer_idx, hq, hkv, d, scale`` then ``custom_op_tail``; ``attend_end`` by keyword when
    the case has it): the written cache rows and the output."""
    import torch

    import llmc.plugins.paged_attention.torch_op  # noqa: F401  (registers torch.ops.llmc)
    from llmc.plugins.paged_attention import kv_binding

    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    kw = {"attend_end": torch.from_numpy(attrs["attend_end"])} if attrs.get("attend_end") is not None else {}
    pool = [tuple(c.copy() for c in caches)]
    with kv_binding.bound_pool(pool):
        got = torch.ops.llmc.paged_attention(*t.values(), 0, hq, hkv, d, attrs["scale"], *custom_op_tail, **kw)
    np.testing.assert_array_equal(pool[0][0], k_ref)
    np.testing.assert_array_equal(pool[0][1], v_ref)
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)


def check_torch_ops(inputs: dict, caches: tuple, attrs: dict, hq: int, hkv: int, d: int, *,
                    custom_op_tail: tuple, torch_kwargs: dict) -> None:
    """:func:`check_torch_custom_op`, and the CUDA engine's torch attention
    (``runtime.cuda.ops.paged_attention_torch`` with ``torch_kwargs``) on CPU tensors, which must also write the
    reference's cache rows."""
    import torch

    from llmc.runtime.workers.cuda.ops import paged_attention_torch

    check_torch_custom_op(inputs, caches, attrs, hq, hkv, d, custom_op_tail=custom_op_tail)
    expected, (k_ref, v_ref) = run_reference(inputs, caches, attrs)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}

    k, v = (torch.from_numpy(c.copy()) for c in caches)
    got = paged_attention_torch(*t.values(), k, v, num_heads=hq, num_kv_heads=hkv, scale=attrs["scale"],
                                **torch_kwargs)
    assert torch.equal(k, torch.from_numpy(k_ref)) and torch.equal(v, torch.from_numpy(v_ref))
    np.testing.assert_allclose(got.numpy(), expected, rtol=RTOL, atol=ATOL)


def check_triton(inputs: dict, caches: tuple, attrs: dict, num_splits: int) -> np.ndarray:
    """The Triton kernel under the interpreter (float32), ``num_splits`` > 1: split-KV with its combine; returns its
    output."""
    import torch

    from llmc.testing.paged_attention import check_case

    if attrs.get("attend_end") is not None:  # a tensor for the kernel (the reference reads it through np.asarray)
        attrs = {**attrs, "attend_end": torch.from_numpy(np.asarray(attrs["attend_end"], dtype=np.int64))}
    got, _ = check_case(inputs, caches, attrs, atol={"fp32": ATOL}, num_splits=num_splits)
    return got
