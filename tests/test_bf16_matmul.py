"""llmc.Bf16MatMul (plugins/bf16_matmul): float32 rows times a bfloat16 weight, exactly.

The op is held to a float64 numpy reference on random bfloat16 weights and random rows (N across the 48-column
panel edges, K odd, M across the 8-row chunks); the AVX-512 path must equal the scalar path bit for bit, and a row's
output must not depend on the other rows of its batch (one chain along k per output). Packing refuses values that
are not bfloat16, and the op refuses mismatched shapes with one line.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

from llmc.plugins.bf16_matmul import PANEL, bf16_exact, pack, reference, single_op_model, unpack
from llmc.plugins.paged_attention import ort_native
from llmc.testing.ort_sessions import native_session

ISAS = {0: "scalar", 1: "AVX2", 2: "AVX-512"}


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.05) -> np.ndarray:
    """float32 values that are all bfloat16 (the low 16 bits cleared), of both signs and many exponents."""
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


@pytest.fixture
def bf16_isa():
    lib = ort_native.load()
    best = next(isa for isa in (2, 1, 0) if lib.llmc_bf16_set_isa(isa) == 0)
    yield lambda isa: lib.llmc_bf16_set_isa(isa) == 0
    lib.llmc_bf16_set_isa(best)


def test_pack_round_trips_and_refuses_rounding():
    rng = np.random.default_rng(1)
    w = random_bf16(rng, (37, 101))
    packed = pack(w)
    assert packed.dtype == np.uint16 and packed.shape == (3, 37, PANEL)
    np.testing.assert_array_equal(unpack(packed, 101), w)
    assert not packed[-1, :, 101 - 2 * PANEL:].any()  # the last panel's padding is zeros
    assert bf16_exact(w) and not bf16_exact(w + np.float32(1e-4))
    with pytest.raises(ValueError, match="not bfloat16"):
        pack(rng.standard_normal((4, 4)).astype(np.float32))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (8, 33, 49), (13, 160, 200), (3, 7, 1), (40, 96, 144)])
def test_op_matches_reference(isa, m, k, n, bf16_isa):
    if not bf16_isa(isa):
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    rng = np.random.default_rng([m, k, n, isa])
    w = random_bf16(rng, (k, n))
    x = rng.standard_normal((m, k)).astype(np.float32)
    packed = pack(w)
    want = reference(x, packed, n)
    for threads in (1, 2):
        got = native_session(single_op_model(packed, n), threads=threads).run(None, {"X": x})[0]
        assert got.shape == (m, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_vector_path_equals_scalar_and_rows_are_batch_invariant(bf16_isa):
    """One FMA chain along k per output, in every path and for any number of rows: the AVX2 and AVX-512 outputs equal
    the scalar ones bit for bit, and each row of a 21-row batch (three chunks, the widened panel) equals that row
    alone and in a batch of 5 (straight from bfloat16)."""
    rng = np.random.default_rng(7)
    k, n = 300, 130
    packed = pack(random_bf16(rng, (k, n)))
    x = rng.standard_normal((21, k)).astype(np.float32)
    model = single_op_model(packed, n)
    outs = {}
    for isa in ISAS:
        if not bf16_isa(isa):
            continue
        session = native_session(model, threads=2)
        whole = session.run(None, {"X": x})[0]
        five = session.run(None, {"X": x[3:8]})[0]
        np.testing.assert_array_equal(five, whole[3:8])
        for i in (0, 9, 20):
            np.testing.assert_array_equal(session.run(None, {"X": x[i:i + 1]})[0], whole[i:i + 1])
        outs[isa] = whole
    for isa in outs:
        np.testing.assert_array_equal(outs[isa], outs[0])


def test_op_refuses_bad_inputs():
    rng = np.random.default_rng(3)
    packed = pack(random_bf16(rng, (16, 50)))
    model = onnx.load_from_string(single_op_model(packed, 50))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "K"  # so that ONNX Runtime lets X through
    session = native_session(model.SerializeToString())
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match="X must have K = 16"):
        session.run(None, {"X": rng.standard_normal((2, 15)).astype(np.float32)})
    wrong_n = native_session(single_op_model(packed, 97))  # 97 columns need 3 panels, W has 2
    with pytest.raises((Fail, InvalidArgument, RuntimeException), match=r"W must have shape \(3, 16, 48\)"):
        wrong_n.run(None, {"X": rng.standard_normal((2, 16)).astype(np.float32)})
