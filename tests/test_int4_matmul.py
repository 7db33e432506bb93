"""``llmc.Int4MatMul``, the native INT4 matmul, in a real ONNX Runtime session.

Differential: fresh normal weights quantized by :mod:`llmc.quant.int4` (symmetric and with zero
points, every group size, ragged N and K), packed by :mod:`llmc.plugins.int4_matmul.pack`, run for
batches of 1 to 70 rows on every instruction-set path this CPU has (scalar, AVX2, AVX-512 VNNI), on
one thread and on ONNX Runtime's pool; against :func:`reference.int4_matmul`, which does the same
integer arithmetic in numpy (so the agreement is to float rounding, 1e-5 of the output's scale), and
against float matmul with the dequantized weights (bounded by int8 activation rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.plugins.int4_matmul import pack, reference
from llmc.plugins.paged_attention import ort_native
from llmc.quant import int4
from llmc.testing.ort_sessions import native_session

ISAS = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}


def _pack(q: int4.Int4Weights) -> pack.Int4Tiles:
    return pack.pack(q.q, q.scales, q.zero_points, q.group_size, q.k)


def _ref(x: np.ndarray, q: int4.Int4Weights) -> np.ndarray:
    return reference.int4_matmul(x, q.q, q.scales, q.zero_points, q.group_size)


def _model(t: pack.Int4Tiles, rank: int = 2, k_dim: int | str | None = None) -> bytes:
    inits = [numpy_helper.from_array(t.w, "W"), numpy_helper.from_array(t.scales, "scales"),
             numpy_helper.from_array(t.mins, "mins")]
    node = helper.make_node("Int4MatMul", ["X", "W", "scales", "mins"], ["Y"], domain="llmc",
                            K=t.k, N=t.n, group_size=t.group_size)
    lead = ["B", "M"][-(rank - 1):] if rank > 1 else []
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [*lead, k_dim or t.k])
    g = helper.make_graph([node], "int4", [x], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*lead, t.n])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1)])
    return m.SerializeToString()


def _available_isas() -> list[int]:
    lib = ort_native.load()
    best = lib.llmc_int4_get_isa()
    try:
        return [i for i in ISAS if lib.llmc_int4_set_isa(i) == 0]
    finally:
        lib.llmc_int4_set_isa(best)


@pytest.fixture
def isa_setter():
    lib = ort_native.load()
    best = lib.llmc_int4_get_isa()
    yield lambda isa: lib.llmc_int4_set_isa(isa)
    lib.llmc_int4_set_isa(best)


CASES = [  # (N, K, group size, symmetric)
    (64, 256, 128, False),
    (40, 192, 64, True),  # N not a multiple of 16
    (96, 200, 32, False),  # K not a multiple of the group size (padded with zero weights)
    (33, 128, 128, True),
    (272, 576, 64, False),
    (48, 576, 128, False),  # the 110M shape's K: a padded last group of 64 (AVX-512 quantizes it, then pads)
    (32, 208, 64, True),  # a last group of 16
]


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("n,k,gs,sym", CASES)
def test_matches_reference(isa, n, k, gs, sym, isa_setter):
    if isa not in _available_isas():
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    rng = np.random.default_rng([n, k, gs, isa])
    q = int4.quantize_rtn(rng.standard_normal((n, k)).astype(np.float32), gs, sym)
    t = _pack(q)
    assert isa_setter(isa) == 0
    for threads in (1, 2):
        sess = native_session(_model(t), threads)
        for m in (1, 3, 8, 13, 70):
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)
            x[:, rng.integers(0, k)] *= 20.0  # an outlier column, as activations have
            y = sess.run(None, {"X": x})[0]
            want = _ref(x, q)
            scale = np.abs(want).max()
            np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * scale, err_msg=f"M={m} threads={threads}")
            # And the float product with the dequantized weights, up to int8 activation rounding (the
            # outlier column makes its groups coarse: up to ~3.5% of the largest output here).
            exact = x @ q.dequantize().T
            err = np.abs(y - exact).max() / np.abs(exact).max()
            assert err < 0.06, f"M={m}: {err:.4f} from the float product"


def test_leading_dims_and_all_paths_agree(isa_setter):
    rng = np.random.default_rng(7)
    q = int4.quantize_rtn(rng.standard_normal((48, 128)).astype(np.float32), 64, False)
    t = _pack(q)
    x = rng.standard_normal((2, 5, 128)).astype(np.float32)
    outs = []
    for isa in _available_isas():
        isa_setter(isa)
        outs.append(native_session(_model(t, rank=3), 1).run(None, {"X": x})[0])
    assert outs[0].shape == (2, 5, 48)
    want = _ref(x.reshape(10, 128), q).reshape(2, 5, 48)
    for y in outs:
        np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_all_zero_rows_and_groups():
    rng = np.random.default_rng(3)
    q = int4.quantize_rtn(rng.standard_normal((32, 128)).astype(np.float32), 64, False)
    t = _pack(q)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[0] = 0.0
    x[1, :64] = 0.0
    y = native_session(_model(t), 1).run(None, {"X": x})[0]
    assert np.all(y[0] == 0.0)
    np.testing.assert_allclose(y, _ref(x, q), rtol=0, atol=1e-5 * np.abs(y).max())


def test_shape_errors_name_the_input():
    rng = np.random.default_rng(1)
    q = int4.quantize_rtn(rng.standard_normal((32, 128)).astype(np.float32), 64, True)
    sess = native_session(_model(_pack(q), k_dim="K"), 1)  # so that ORT itself does not check K first
    with pytest.raises(Exception, match="X must have K = 128"):
        sess.run(None, {"X": np.ones((2, 64), np.float32)})


def test_pack_layout_by_hand():
    """Byte 4c + i of octet o: q[c, 8o + i] low, q[c, 8o + 4 + i] high; scales/mins by tile."""
    rng = np.random.default_rng(5)
    q = int4.quantize_rtn(rng.standard_normal((20, 64)).astype(np.float32), 32, False)
    t = _pack(q)
    assert t.w.shape == (2, 8, 64) and t.scales.shape == (2, 2, 16)
    for col in (0, 7, 15, 16, 19):
        tile, c = divmod(col, 16)
        for o in range(8):
            for i in range(4):
                b = t.w[tile, o, 4 * c + i]
                assert b & 0x0F == q.q[col, 8 * o + i] and b >> 4 == q.q[col, 8 * o + 4 + i]
        assert np.array_equal(t.scales[tile, :, c], q.scales[col])
        assert np.allclose(t.mins[tile, :, c], q.scales[col] * q.zero_points[col])
    assert np.all(t.w[1, :, 16:] == 0) and np.all(t.scales[1, :, 4:] == 0)  # padding columns


def test_runtime_sets_parallel_threshold_by_spinning():
    """A session whose threads spin hands smaller matmuls to them (waking them is cheap); a passive one
    keeps them on the calling thread (ort_native.INT4_PARALLEL_MIN, measured)."""
    from llmc.runtime.workers.ort.session import OrtSession

    rng = np.random.default_rng(2)
    model = _model(_pack(int4.quantize_rtn(rng.standard_normal((32, 128)).astype(np.float32), 64, False)))
    before = ort_native.set_int4_parallel_min(-1)  # -1: the library default
    try:
        for spin in (True, False):
            OrtSession(model, num_threads=2, spin=spin)
            assert ort_native.set_int4_parallel_min(-1) == ort_native.INT4_PARALLEL_MIN[spin]
    finally:
        ort_native.set_int4_parallel_min(before)


def _swiglu_model(t: pack.Int4Tiles) -> bytes:
    order = pack.gate_up_order(t.n)
    inits = [numpy_helper.from_array(np.ascontiguousarray(t.w[order]), "W"),
             numpy_helper.from_array(np.ascontiguousarray(t.scales[order]), "scales"),
             numpy_helper.from_array(np.ascontiguousarray(t.mins[order]), "mins")]
    node = helper.make_node("Int4MatMul", ["X", "W", "scales", "mins"], ["Y"], domain="llmc",
                            K=t.k, N=t.n, group_size=t.group_size, activation=1)
    g = helper.make_graph([node], "int4_swiglu", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", t.k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", t.n // 2])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1)]
    return helper.make_model(g, opset_imports=opsets).SerializeToString()


@pytest.mark.parametrize("isa", list(ISAS))
def test_swiglu_epilogue_matches_reference(isa, isa_setter):
    """activation=1 on the gate/up-interleaved tiles = silu(gate) * up of the unfused product, on every ISA,
    1 and 2 threads, 1 to 70 rows (the kernel's int32 dot products are the same; the epilogue's sigmoid is
    within float32 rounding of the float64 reference)."""
    if isa not in _available_isas():
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    rng = np.random.default_rng([isa, 32])
    n, k, gs = 2 * 96, 320, 64
    q = int4.quantize_rtn(rng.standard_normal((n, k)).astype(np.float32), gs, False)
    t = _pack(q)
    assert isa_setter(isa) == 0
    for threads in (1, 2):
        sess = native_session(_swiglu_model(t), threads)
        for m in (1, 5, 8, 70):
            x = (rng.standard_normal((m, k)) * 0.5).astype(np.float32)
            y = sess.run(None, {"X": x})[0]
            want = reference.swiglu(_ref(x, q))
            assert y.shape == (m, n // 2)
            np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"M={m}")
            assert np.abs(want).max() > 0.5


def test_swiglu_epilogue_refuses_partial_tiles():
    rng = np.random.default_rng(0)
    q = int4.quantize_rtn(rng.standard_normal((48, 64)).astype(np.float32), 64, False)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack.gate_up_order(48)
    t = _pack(q)
    node = helper.make_node("Int4MatMul", ["X", "W", "scales", "mins"], ["Y"], domain="llmc", K=64, N=48,
                            group_size=64, activation=1)
    g = helper.make_graph([node], "bad", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", 64])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(t.w, "W"), numpy_helper.from_array(t.scales, "scales"),
                           numpy_helper.from_array(t.mins, "mins")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1)])
    with pytest.raises(Exception, match=r"activation=1 \(swiglu\) needs N % 32 == 0"):
        native_session(model.SerializeToString(), 1).run(None, {"X": rng.standard_normal((2, 64)).astype(np.float32)})
