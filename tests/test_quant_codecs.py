"""Quantization codecs against independent references: torch's float8_e4m3fn, ml_dtypes' float8/float4
types, and ONNX Runtime's own MatMulNBits / GatherBlockQuantized kernels for the INT4 packing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from llmc.quant import fp8, int4, nvfp4
from llmc.quant.minifloat import E2M1, E4M3


def _spread(rng, n, lo, hi):
    """Random float32 of both signs whose magnitudes are log-uniform in [2**lo, 2**hi]."""
    mag = np.exp2(rng.uniform(lo, hi, n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def _midpoints(fmt, limit):
    """Every exact tie between neighbouring finite values of ``fmt`` up to ``limit``, both signs."""
    t = np.unique(fmt.table[np.isfinite(fmt.table)].astype(np.float64))
    t = t[(t >= 0) & (t <= limit)]
    mids = ((t[1:] + t[:-1]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (t[1:] + t[:-1]) / 2)  # ties are exact in float32
    return np.concatenate([mids, -mids])


def _torch_e4m3(x):
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


# -- FP8 E4M3 ------------------------------------------------------------------------------------

def test_e4m3_decode_table_matches_ml_dtypes_for_every_code():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(E4M3.table, ref)  # NaN codes compare equal as NaN
    assert np.isnan(E4M3.table[[0x7F, 0xFF]]).all() and np.isfinite(E4M3.table).sum() == 254


@pytest.mark.parametrize("lo,hi", [(-12, -6), (-6, 0), (0, 8.8)])  # subnormals, small normals, large normals
def test_e4m3_encode_matches_torch_and_ml_dtypes(lo, hi):
    rng = np.random.default_rng(hash((lo, hi)) % 2**32)
    x = np.clip(_spread(rng, 200_000, lo, hi), -448, 448)
    codes = E4M3.encode(x)
    np.testing.assert_array_equal(codes, _torch_e4m3(x))
    np.testing.assert_array_equal(codes, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_e4m3_ties_round_to_even():
    mids = _midpoints(E4M3, 448)
    codes = E4M3.encode(mids)
    np.testing.assert_array_equal(codes, _torch_e4m3(mids))
    np.testing.assert_array_equal(codes, mids.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.all(codes & 1 == 0)  # the even neighbour has a zero last mantissa bit


def test_e4m3_saturates_and_keeps_nan_and_signed_zero():
    big = np.array([448.0, 449.0, 464.0, 465.0, 1e4, 3e38, np.inf], np.float32)
    assert list(E4M3.encode(big)) == [0x7E] * len(big)
    assert list(E4M3.encode(-big)) == [0xFE] * len(big)
    # torch saturates too; ml_dtypes overflows to NaN past the rounding boundary (checked below it).
    np.testing.assert_array_equal(E4M3.encode(big[:-1]), _torch_e4m3(big[:-1]))
    nan = np.array([np.nan, -np.nan], np.float32)
    assert list(E4M3.encode(nan)) == list(_torch_e4m3(nan)) == [0x7F, 0xFF]
    assert list(E4M3.encode(np.array([0.0, -0.0], np.float32))) == [0x00, 0x80]
    tiny = np.array([2.0**-10, 2.0**-10 * 1.01, 2.0**-11], np.float32)  # half the smallest subnormal, and around it
    np.testing.assert_array_equal(E4M3.encode(tiny), _torch_e4m3(tiny))


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_fp8_scaled_quantization(axis):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((48, 40)) * rng.uniform(0.01, 5, (1, 40))).astype(np.float32)
    q = fp8.quantize(x, axis=axis)
    scale = q.scale if axis is None else np.expand_dims(q.scale, 1 - axis)
    np.testing.assert_array_equal(q.codes, _torch_e4m3(x / scale))
    # The largest magnitude of each tensor/channel lands exactly on ±448.
    assert np.all(np.abs(E4M3.decode(q.codes)).max(axis=None if axis is None else 1 - axis) == 448)
    err = np.abs(q.dequantize() - x)
    assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) + 1e-12)


@pytest.mark.parametrize("shape, axis", [((48, 40), None), ((48, 40), 0), ((48, 40), 1), ((6, 8, 10), 0),
                                         ((6, 8, 10), 1), ((6, 8, 10), None), ((300,), None)])
def test_fp8_quantize_in_chunks_of_rows_equals_one_pass(shape, axis, monkeypatch):
    """quantize() divides, clips and casts a chunk of rows at a time: the codes and scales of one whole-array pass
    (max |x| taken as max(max x, -min x)), infinities and signed zeros included."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape))).astype(np.float32)
    x.reshape(-1)[[3, 17, 29]] = [np.inf, -0.0, -3e38]
    red = None if axis is None else tuple(d for d in range(x.ndim) if d != axis)
    with np.errstate(invalid="ignore"):
        want_scale = fp8.scale_for(np.abs(x).max(axis=red))
        want = E4M3.encode(x / fp8._broadcast(want_scale, axis, x.ndim))
    monkeypatch.setattr(fp8, "QUANTIZE_CHUNK", 7)  # rows of 40, 80 or 1 element: every row its own chunk
    with np.errstate(invalid="ignore"):
        q = fp8.quantize(x, axis=axis)
    np.testing.assert_array_equal(q.scale, want_scale)
    np.testing.assert_array_equal(q.codes, want)


# -- FP4 E2M1 and NVFP4 --------------------------------------------------------------------------

def test_e2m1_table_encode_and_ties_match_ml_dtypes():
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1.table, ref)
    rng = np.random.default_rng(4)
    x = np.concatenate([(rng.standard_normal(100_000) * 3).astype(np.float32), _midpoints(E2M1, 6),
                        np.array([0.0, -0.0, 6.5, -7.0, 1e9, np.inf, -np.inf], np.float32)])
    np.testing.assert_array_equal(E2M1.encode(x), x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    with pytest.raises(ValueError, match="no NaN"):
        E2M1.encode(np.array([1.0, np.nan], np.float32))


def test_nvfp4_matches_ml_dtypes_reference():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((24, 128)) * np.exp2(rng.uniform(-8, 4, (24, 8))).repeat(16, axis=1)).astype(np.float32)
    t = nvfp4.quantize(x)
    # Independent reconstruction with ml_dtypes' own float types.
    g = np.float32(np.abs(x).max() / (6 * 448))
    assert t.global_scale == g
    blocks = x.reshape(24, 8, 16)
    ref_scale_codes = (np.abs(blocks).max(-1) / np.float32(6) / g).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(t.block_scales, ref_scale_codes.view(np.uint8))
    bscale = ref_scale_codes.astype(np.float32) * g
    ref_codes = (blocks / bscale[..., None]).astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(t.codes, ref_codes.view(np.uint8).reshape(24, 128))
    ref_deq = (ref_codes.astype(np.float32) * bscale[..., None]).reshape(24, 128)
    np.testing.assert_array_equal(t.dequantize(), ref_deq)
    # The global maximum is represented exactly (6 × 448 × g), and no block saturates badly.
    assert np.abs(t.dequantize()).max() == pytest.approx(np.abs(x).max(), rel=1e-6)
    rel = np.abs(t.dequantize() - x).max(-1) / np.abs(x).max(-1)
    assert rel.max() < 0.35
    packed = t.packed_codes()
    assert packed.shape == (24, 64)
    unpacked = np.stack([packed & 0xF, packed >> 4], -1).reshape(24, 128)
    np.testing.assert_array_equal(unpacked, t.codes)


def test_nvfp4_rejects_bad_shapes_and_zero_blocks_are_exact():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(np.ones((2, 20), np.float32))
    x = np.zeros((2, 32), np.float32)
    x[0, 16:] = np.linspace(-1, 1, 16)
    t = nvfp4.quantize(x)
    assert np.all(t.dequantize()[:, :16] == 0) and np.all(t.dequantize()[1] == 0)


# -- INT4 group-wise -----------------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_rtn_error_bound_and_codes(group, symmetric):
    rng = np.random.default_rng(group + symmetric)
    w = (rng.standard_normal((40, 3 * group + 16)) * 0.1).astype(np.float32)  # K not a multiple of the group
    q = int4.quantize_rtn(w, group, symmetric)
    assert q.q.shape == (40, 4 * group) and q.scales.shape == (40, 4) and q.q.max() <= 15
    err = np.abs(q.dequantize() - w)
    bound = np.abs(np.repeat(q.scales, group, axis=1)[:, : w.shape[1]]) / 2
    if symmetric:  # the side opposite the group's peak reaches 7 steps, so values up to 8 steps clip by <= 1 step
        bound = np.where(q.q[:, : w.shape[1]] == 15, 2 * bound, bound)
    assert np.all(err <= bound * (1 + 1e-6))
    if symmetric:
        assert q.zero_points is None
        # Each group's largest magnitude is exact (it defines the scale).
        groups = int4.padded_groups(w, group)
        peak = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]
        deq = int4.padded_groups(q.dequantize(), group)
        np.testing.assert_array_equal(np.take_along_axis(deq, np.abs(groups).argmax(-1)[..., None], -1)[..., 0], peak)
    else:
        assert q.zero_points.shape == (40, 4) and q.zero_points.max() <= 15


def _ort_session(nodes, inits, inputs, outputs):
    import onnxruntime as ort
    from onnx import helper

    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 11
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("group,k,symmetric", [(32, 160, False), (64, 256, True), (128, 200, False), (128, 384, True)])
def test_int4_packing_matches_ort_matmulnbits(group, k, symmetric):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(k)
    n = 48
    w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
    q = int4.quantize_rtn(w, group, symmetric)
    inits = [numpy_helper.from_array(q.matmulnbits_b(), "B"), numpy_helper.from_array(q.scales.reshape(-1), "S")]
    ins = ["A", "B", "S"]
    if not symmetric:
        inits.append(numpy_helper.from_array(q.matmulnbits_zero_points(), "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=group)
    sess = _ort_session([node], inits, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])])
    a = rng.standard_normal((7, k)).astype(np.float32)
    y = sess.run(None, {"A": a})[0]
    ref = a.astype(np.float64) @ q.dequantize().astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # And the dequantized weights really approximate w (a wrong packing could still be self-consistent).
    exact = a @ w.T
    assert np.sqrt(np.mean((exact - y) ** 2)) < 0.15 * np.sqrt(np.mean(exact**2))


def test_int4_concat_is_quantizing_the_stack():
    rng = np.random.default_rng(9)
    a, b = (rng.standard_normal((16, 128)).astype(np.float32) for _ in range(2))
    both = int4.concat([int4.quantize_rtn(a, 64), int4.quantize_rtn(b, 64)])
    whole = int4.quantize_rtn(np.concatenate([a, b]), 64)
    np.testing.assert_array_equal(both.matmulnbits_b(), whole.matmulnbits_b())
    np.testing.assert_array_equal(both.scales, whole.scales)
    np.testing.assert_array_equal(both.matmulnbits_zero_points(), whole.matmulnbits_zero_points())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [96, 320])  # 320 / 128: a padded last group and an odd number of zero-point groups
def test_spilled_int4_weights_read_back_identical(tmp_path, symmetric, k):
    """Calibrated INT4 weights spilled to disk (two codes a byte) come back bit for bit, and dequantize the same."""
    from llmc.quant import int4

    rng = np.random.default_rng(k + symmetric)
    w = int4.quantize_rtn(rng.standard_normal((24, k)).astype(np.float32), 128 if k > 128 else 32, symmetric)
    handle = int4.spill(w, tmp_path / "w.npz")
    assert (handle.n, handle.k, handle.group_size) == (w.n, w.k, w.group_size)
    back = int4.materialize(handle)
    assert np.array_equal(back.q, w.q) and np.array_equal(back.scales, w.scales)
    assert (back.zero_points is None) == symmetric
    if not symmetric:
        assert np.array_equal(back.zero_points, w.zero_points)
    assert np.array_equal(handle.dequantize(), w.dequantize())
    assert int4.materialize(w) is w


@pytest.mark.parametrize("shape, transposed", [((3000, 700), False), ((700, 3000), True), ((2_100_000,), False)])
def test_chunked_e4m3_encode_equals_the_whole_array_encode(shape, transposed, monkeypatch):
    """Large arrays are encoded a chunk of rows at a time (bounded temporaries): the same codes as one pass, for
    contiguous, transposed and 1-D inputs, specials (NaN, inf, signed zero, subnormals, ties) included."""
    from llmc.quant import minifloat

    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-12, 8, shape))).astype(np.float32)
    flat = x.reshape(-1)
    flat[:6] = [np.nan, -np.inf, np.inf, -0.0, 2.0**-9, 0.5625]
    if transposed:
        x = x.T
    x = x.astype(np.float64)  # float32 takes the ml_dtypes path (tested below); float64 the chunked reference
    whole = minifloat.E4M3._encode(x)
    monkeypatch.setattr(minifloat, "ENCODE_CHUNK", 4096)
    assert np.array_equal(minifloat.E4M3.encode(x), whole)
    monkeypatch.setattr(minifloat, "ENCODE_CHUNK", 1 << 20)
    assert np.array_equal(minifloat.E4M3.encode(x), whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fast_e4m3_encode_equals_the_reference_on_every_float16_and_random_float32(dtype):
    """Both fast paths (torch's cast, and ml_dtypes' where torch is not installed) give the reference codec's codes:
    every float16 bit pattern (NaN, inf, subnormals, ties included), and float32 values over the whole range with
    exact ties and values just above 448."""
    from llmc.quant import minifloat

    if dtype == np.float16:
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    else:
        rng = np.random.default_rng(3)
        x = (rng.standard_normal(1 << 20) * np.exp(rng.uniform(-25, 8, 1 << 20))).astype(np.float32)
        grid = minifloat.E4M3.table[np.isfinite(minifloat.E4M3.table)]
        mids = ((np.sort(grid)[1:] + np.sort(grid)[:-1]) / 2).astype(np.float32)
        x = np.concatenate([x, mids, -mids, np.float32([448.1, 463.9, 464.0, 1e30, -1e30, np.nan, -np.nan, -0.0])])
    want = minifloat.E4M3._encode(x)
    assert np.array_equal(minifloat.E4M3.encode(x), want)
    assert np.array_equal(minifloat._e4m3_ml_dtypes(x), want)


@pytest.mark.parametrize("case", ["float16_bits", "random_float32", "transposed"])
def test_torch_e4m3_encode_equals_the_reference(case):
    """fp8.encode (torch's cast after saturating) gives the reference codec's codes bit for bit: every float16 bit
    pattern, float32 over the whole range with exact ties, values past 448, infinities, signed NaN and zero; for
    contiguous and transposed input; the caller's array is not changed when it is not writeable."""
    from llmc.quant import fp8, minifloat

    rng = np.random.default_rng(5)
    if case == "float16_bits":
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        x = (rng.standard_normal(1 << 20) * np.exp(rng.uniform(-25, 8, 1 << 20))).astype(np.float32)
        grid = minifloat.E4M3.table[np.isfinite(minifloat.E4M3.table)]
        mids = ((np.sort(grid)[1:] + np.sort(grid)[:-1]) / 2).astype(np.float32)
        x = np.concatenate([x, mids, -mids, np.float32([448.1, 463.9, 464.0, 1e30, -1e30, np.inf, -np.inf,
                                                        np.nan, -np.nan, -0.0, 0.0])])
    if case == "transposed":
        x = x[: (x.size // 64) * 64].reshape(-1, 64).T
    want = minifloat.E4M3._encode(x.astype(np.float64))
    x.flags.writeable = False
    before = x.copy()
    got = fp8.encode(x)
    assert got.dtype == np.uint8 and got.shape == x.shape
    assert np.array_equal(got, want)
    assert np.array_equal(x, before, equal_nan=True)
