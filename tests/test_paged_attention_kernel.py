"""Differential tests: the C++ CPU PagedAttention kernel against the numpy reference.

Every case builds fresh random inputs (no zeros anywhere: caches, queries, keys and values are
all drawn from a normal distribution), runs the reference and the kernel on separate copies of
the same caches, and checks that

- the caches are written in place and end up bit-identical to the reference's caches
  (the kernel copies float32 rows verbatim and converts float16 with round-to-nearest-even, as
  numpy does);
- the outputs agree to float32 accuracy. Both sides compute in float32, but in a different order:
  the reference takes one BLAS matmul per head and a softmax over the whole row, the kernel
  SIMD-reduced dot products and an online softmax that rescales its running sum block by block.
  Each output is a convex combination of O(1) values; with unit-scale scores the two differ by
  a few float32 ulps times a factor growing with the context length (observed max |diff| 7e-7 at
  1500 positions), so RTOL/ATOL leave more than an order of magnitude of headroom. Large scores
  (queries scaled up to make the softmax peaked, |score| up to ~40) carry a float32 rounding
  error of ~|score| * 2^-24 * sqrt(D) each, which becomes a relative error of the softmax weights
  of the same size: there both implementations are ~1e-5 away from a float64 computation
  (observed max |diff| 1.6e-5), hence ATOL_PEAKED. A wrong position, mask or head mapping
  produces differences of order 1e-1, far above either tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmc.plugins.paged_attention import reference
from llmc.plugins.paged_attention.cpu import load_kernel, paged_attention_cpu
from llmc.testing import paged_attention as pa_cases

RTOL = 1e-4
ATOL = 2e-5
ATOL_PEAKED = 1e-4  # for queries scaled by 4-8 (see the module docstring)

kernel = load_kernel()


def make_case(rng: np.random.Generator, **kw):
    """``(inputs, k_cache, v_cache, attrs)`` for :func:`llmc.testing.paged_attention.make_case`'s batch."""
    inputs, (k_cache, v_cache), attrs = pa_cases.make_case(rng, **kw)
    return inputs, k_cache, v_cache, attrs


def check(inputs, k_cache, v_cache, attrs, *, rtol=RTOL, atol=ATOL):
    """Run both implementations on copies of the caches; compare caches exactly and outputs closely."""
    k_ref, v_ref = k_cache.copy(), v_cache.copy()
    k_ker, v_ker = k_cache.copy(), v_cache.copy()
    k_ptr, v_ptr = k_ker.ctypes.data, v_ker.ctypes.data
    expected = reference.paged_attention(**inputs, k_cache=k_ref, v_cache=v_ref, **attrs)
    got = paged_attention_cpu(**inputs, k_cache=k_ker, v_cache=v_ker, **attrs)

    assert got.dtype == np.float32 and got.shape == expected.shape
    assert k_ker.ctypes.data == k_ptr and v_ker.ctypes.data == v_ptr
    np.testing.assert_array_equal(k_ker.view(np.uint8), k_ref.view(np.uint8), err_msg="k_cache differs")
    np.testing.assert_array_equal(v_ker.view(np.uint8), v_ref.view(np.uint8), err_msg="v_cache differs")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)
    return got, expected


MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12)]  # decode / full prefill / chunks


@pytest.fixture(params=["avx512", "avx2", "baseline"])
def isa(request):
    """Runs a test on each code path this CPU has: AVX-512 (the tiled loop at width 16), AVX2+FMA and the
    x86-64-v2 baseline (a path the CPU lacks is skipped, saying so)."""
    try:
        kernel._set_isa(request.param)
    except ValueError as exc:
        pytest.skip(str(exc))
    yield kernel.get_isa()
    kernel._set_isa("auto")


# -------------------------------------------------------------------------------------------
# Differential tests


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 4), (8, 2), (16, 2)], ids=["gqa1", "gqa2", "gqa4", "gqa8"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_mixed_batch(hq, hkv, d, bs):
    rng = np.random.default_rng([hq, hkv, d, bs])
    case = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=MIXED)
    check(*case)


def test_both_isas(isa):
    rng = np.random.default_rng(11)
    check(*make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, pad_rows=2))
    check(*make_case(rng, hq=6, hkv=3, d=80, bs=8, seqs=[(45, 3), (19, 1)]))  # D not a multiple of 64


@pytest.mark.parametrize("d,bs", [(36, 16), (64, 12), (20, 5)], ids=["d36", "bs12", "d20-bs5"])
def test_per_row_path(isa, d, bs):
    """Head or block sizes that are not multiples of 8 take the per-row loop instead of the tiled one."""
    rng = np.random.default_rng(d * 100 + bs)
    check(*make_case(rng, hq=6, hkv=2, d=d, bs=bs, seqs=MIXED, pad_rows=1))


@pytest.mark.parametrize("window", [0, 7, 40])
def test_prefill_tiles_with_window_and_split(isa, window):
    """Long prompts (many row tiles, GQA 4) and a short chunk at long context (split block ranges)."""
    rng = np.random.default_rng(window)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=[(300, 300), (900, 5), (61, 61)])
    check(inputs, k, v, {**attrs, "sliding_window": window})


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    """Random shapes: odd head sizes, random batch composition, long contexts over many blocks."""
    rng = np.random.default_rng(1000 + seed)
    hkv = int(rng.choice([1, 2, 3]))
    hq = hkv * int(rng.choice([1, 2, 4, 8]))
    d = int(rng.choice([16, 40, 64, 96, 128]))
    bs = int(rng.choice([1, 4, 8, 16, 32]))
    seqs = []
    for _ in range(int(rng.integers(1, 7))):
        ctx = int(rng.integers(1, 400))
        n_new = 1 if rng.random() < 0.5 else int(rng.integers(1, min(ctx, 24) + 1))
        seqs.append((ctx, n_new))
    check(*make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs, pad_rows=int(rng.integers(0, 3))))


def test_long_context_many_blocks():
    rng = np.random.default_rng(7)
    check(*make_case(rng, hq=8, hkv=2, d=64, bs=8, seqs=[(1500, 1), (777, 4), (1024, 1)]))


@pytest.mark.parametrize(
    "window,softcap,cache_dtype",
    [(0, 0.0, np.float32), (300, 0.0, np.float32), (1000, 20.0, np.float32), (0, 0.0, np.float16)],
)
def test_split_context(window, softcap, cache_dtype):
    """Few rows with long contexts: each row's blocks are split into ranges merged at the end."""
    rng = np.random.default_rng(window)
    inputs, k, v, attrs = make_case(
        rng, hq=8, hkv=2, d=64, bs=16, seqs=[(2000, 1), (1337, 2)], q_scale=2.0, cache_dtype=cache_dtype
    )
    check(inputs, k, v, attrs | dict(sliding_window=window, softcap=softcap), atol=ATOL_PEAKED)


def test_peaked_scores():
    """Large scores: the running max changes often, so the online rescaling is exercised."""
    rng = np.random.default_rng(8)
    check(*make_case(rng, hq=4, hkv=2, d=64, bs=8, seqs=MIXED, q_scale=8.0), atol=ATOL_PEAKED)


@pytest.mark.parametrize("window", [1, 5, 16, 33, 100, 10_000])
def test_sliding_window(window):
    rng = np.random.default_rng(window)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED)
    check(inputs, k, v, attrs | dict(sliding_window=window))


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap(softcap):
    rng = np.random.default_rng(int(softcap * 10))
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=4, d=128, bs=8, seqs=MIXED, q_scale=4.0)
    check(inputs, k, v, attrs | dict(softcap=softcap), atol=ATOL_PEAKED)


def test_sliding_window_and_softcap(isa):
    rng = np.random.default_rng(21)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=1, d=64, bs=32, seqs=MIXED, q_scale=4.0)
    check(inputs, k, v, attrs | dict(sliding_window=40, softcap=30.0), atol=ATOL_PEAKED)


def test_padding_rows_are_zero_and_not_written():
    rng = np.random.default_rng(5)
    inputs, k, v, attrs = make_case(rng, hq=4, hkv=2, d=64, bs=16, seqs=[(30, 2), (17, 1)], pad_rows=3)
    got, _ = check(inputs, k, v, attrs)
    assert np.array_equal(got[-3:], np.zeros_like(got[-3:]))
    # A sequence with no new rows in this step is skipped entirely (its table is not read).
    inputs["context_lens"] = np.append(inputs["context_lens"], 10**6)
    inputs["query_start_loc"] = np.append(inputs["query_start_loc"], inputs["query_start_loc"][-1])
    inputs["block_tables"] = np.vstack([inputs["block_tables"], np.full_like(inputs["block_tables"][:1], -7)])
    check(inputs, k, v, attrs)


def test_repeated_slot_keeps_last_row():
    rng = np.random.default_rng(6)
    inputs, k, v, attrs = make_case(rng, hq=4, hkv=2, d=64, bs=8, seqs=[(20, 3)], pad_rows=2)
    inputs["slot_mapping"][-2:] = inputs["slot_mapping"][0]  # padding rows overwrite a real slot
    check(inputs, k, v, attrs)


def test_float16_cache(isa):
    rng = np.random.default_rng(9)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, cache_dtype=np.float16)
    check(inputs, k, v, attrs)
    inputs, k, v, attrs = make_case(rng, hq=4, hkv=4, d=40, bs=8, seqs=[(70, 9)], cache_dtype=np.float16)
    check(inputs, k, v, attrs | dict(sliding_window=20, softcap=10.0))


def test_float16_write_rounding_matches_numpy(isa):
    """float32 -> float16 on write: ties, subnormals, overflow, inf and nan, bit-exact with numpy (F16C, 8 at a
    time with NaN-holding octets done by the scalar code, on AVX2 and AVX-512; the scalar code on the baseline)."""
    rng = np.random.default_rng(10)
    special = np.array(
        [
            0.0,
            -0.0,
            1.0,
            65504.0,
            65519.99,
            65520.0,
            -1e6,
            np.inf,
            -np.inf,
            np.nan,
            6e-8,
            2.98e-8,
            2.9802322e-8,
            1e-45,
            6.1e-5,
            1.00048828125,
            1.00146484375,
            -3.0517578e-05,
            1 + 2**-11,
            1 + 3 * 2**-11,
        ],
        dtype=np.float32,
    )
    # Exact ties between two float16 values, normal and subnormal, with odd and even neighbours.
    # (float16 spacing: 2^-24 below 2^-13, 2^-10 in [1, 2), 1 in [1024, 2048).)
    ties = np.array(
        [
            base + (k + 0.5) * ulp
            for k in range(4)
            for base, ulp in ((0.0, 2.0**-24), (2.0**-14, 2.0**-24), (1.0, 2.0**-10), (1024.0, 1.0))
        ],
        np.float32,
    )
    special = np.concatenate([special, ties, -ties])
    d = 64
    bits = rng.integers(0, 2**32, size=d * 8, dtype=np.uint64).astype(np.uint32).view(np.float32)
    key = np.concatenate([special, bits, rng.standard_normal(d * 8 - special.size).astype(np.float32)])
    key = key.reshape(-1, d)
    t = key.shape[0]
    k_ref = np.ones((t, 1, 1, d), dtype=np.float16)
    k_ker, v_ker = k_ref.copy(), k_ref.copy()
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow to inf is the point
        reference.write_kv(key, key, np.arange(t), k_ref, k_ref.copy())
    args = dict(num_heads=1, num_kv_heads=1, scale=1.0)
    no_seq = (np.zeros((0, 1), np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64))
    paged_attention_cpu(np.ones((t, d), np.float32), key, key, np.arange(t), *no_seq, k_ker, v_ker, **args)
    np.testing.assert_array_equal(k_ker.view(np.uint16), k_ref.view(np.uint16))
    np.testing.assert_array_equal(v_ker.view(np.uint16), k_ref.view(np.uint16))


def test_strided_qkv_and_int32_metadata():
    """query/key/value as column slices of one fused QKV tensor; int32 metadata is accepted."""
    rng = np.random.default_rng(12)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED)
    qkv = np.concatenate([inputs["query"], inputs["key"], inputs["value"]], axis=1)
    nq, nk = inputs["query"].shape[1], inputs["key"].shape[1]
    strided = dict(inputs, query=qkv[:, :nq], key=qkv[:, nq : nq + nk], value=qkv[:, nq + nk :])
    assert not strided["query"].flags.c_contiguous
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start_loc"):
        strided[name] = strided[name].astype(np.int32)
    k_ref, v_ref, k_ker, v_ker = k.copy(), v.copy(), k.copy(), v.copy()
    expected = reference.paged_attention(**inputs, k_cache=k_ref, v_cache=v_ref, **attrs)
    got = paged_attention_cpu(**strided, k_cache=k_ker, v_cache=v_ker, **attrs)
    np.testing.assert_array_equal(k_ker, k_ref)
    np.testing.assert_array_equal(v_ker, v_ref)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_thread_count_does_not_change_results():
    rng = np.random.default_rng(13)
    inputs, k, v, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED)
    # An Engine loaded earlier in this worker may have pinned the count: restore whatever was set.
    before = kernel.get_num_threads()
    try:
        kernel.set_num_threads(1)
        assert kernel.get_num_threads() == 1
        one = paged_attention_cpu(**inputs, k_cache=k.copy(), v_cache=v.copy(), **attrs)
        kernel.set_num_threads(3)
        three = paged_attention_cpu(**inputs, k_cache=k.copy(), v_cache=v.copy(), **attrs)
        kernel.set_num_threads(0)  # 0 = the OpenMP default
        assert kernel.get_num_threads() >= 1
    finally:
        kernel.set_num_threads(before)
    assert kernel.get_num_threads() == before
    np.testing.assert_array_equal(one, three)  # each (row, head) is computed by one thread, in one order
    with pytest.raises(ValueError):
        kernel.set_num_threads(-1)


# -------------------------------------------------------------------------------------------
# Error paths: every one raises ValueError before touching the caches.


def _base(rng=None):
    rng = rng or np.random.default_rng(99)
    return make_case(rng, hq=4, hkv=2, d=16, bs=8, seqs=[(20, 3), (9, 1)])


def _bad(mutate, match):
    inputs, k, v, attrs = _base()
    args = dict(inputs, k_cache=k, v_cache=v, **attrs)
    mutate(args)
    k0, v0 = np.array(args["k_cache"], copy=True), np.array(args["v_cache"], copy=True)
    with pytest.raises(ValueError, match=match):
        paged_attention_cpu(**args)
    if isinstance(args["k_cache"], np.ndarray) and args["k_cache"].shape == k0.shape:
        np.testing.assert_array_equal(args["k_cache"], k0)
        np.testing.assert_array_equal(args["v_cache"], v0)


def _set(**kw):
    def mutate(args):
        args.update(kw)

    return mutate


def _edit(name, fn):
    def mutate(args):
        args[name] = fn(args[name])

    return mutate


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


BAD_CASES = {
    "cache_not_contiguous": (_edit("k_cache", lambda a: np.concatenate([a, a], axis=3)[..., ::2]), "C-contiguous"),
    "cache_fortran": (_edit("v_cache", np.asfortranarray), "C-contiguous"),
    "cache_float64": (_edit("k_cache", lambda a: a.astype(np.float64)), "k_cache must be float32 or float16"),
    "cache_big_endian": (_edit("k_cache", lambda a: a.astype(">f4")), "k_cache must be float32"),
    "cache_dtype_mismatch": (_edit("v_cache", lambda a: a.astype(np.float16)), "same dtype"),
    "cache_shape_mismatch": (_edit("v_cache", lambda a: np.ascontiguousarray(a[:-1])), "same shape"),
    "cache_readonly": (_edit("k_cache", _readonly), "writeable"),
    "cache_list": (_edit("k_cache", lambda a: a.tolist()), "numpy.ndarray"),
    "cache_3d": (_edit("k_cache", lambda a: a.reshape(a.shape[0], -1, a.shape[3])), "4-D"),
    "kv_heads_mismatch": (_set(num_kv_heads=1), "KV heads"),
    "heads_not_multiple": (_set(num_heads=3), "multiple of num_kv_heads"),
    "heads_zero": (_set(num_heads=0), "positive"),
    "query_float64": (_edit("query", lambda a: a.astype(np.float64)), "query must be float32"),
    "query_1d": (_edit("query", lambda a: a.ravel()), "query must be 2-D"),
    "query_columns": (_edit("query", lambda a: a[:, :-1]), "num_heads \\* head_size"),
    "key_rows": (_edit("key", lambda a: a[:-1]), "key must have shape"),
    "value_columns": (_edit("value", lambda a: np.hstack([a, a])), "value must have shape"),
    "slot_len": (_edit("slot_mapping", lambda a: a[:-1]), "slot_mapping must have one entry per row"),
    "slot_out_of_range": (_edit("slot_mapping", lambda a: np.append(a[:-1], 10**6)), r"slot_mapping\[3\]"),
    "slot_float": (_edit("slot_mapping", lambda a: a.astype(np.float64)), "integer array"),
    "qsl_len": (_edit("query_start_loc", lambda a: a[:-1]), "len\\(context_lens\\) \\+ 1"),
    "qsl_decreasing": (_edit("query_start_loc", lambda a: np.array([0, 3, 2])), "non-decreasing"),
    "qsl_past_end": (_edit("query_start_loc", lambda a: np.array([0, 3, 5])), "exceeds the number of query rows"),
    "qsl_negative": (_edit("query_start_loc", lambda a: np.array([-1, 3, 4])), ">= 0"),
    "ctx_less_than_new": (_edit("context_lens", lambda a: np.array([2, 9])), "3 new tokens but context_lens = 2"),
    "ctx_negative": (_edit("context_lens", lambda a: np.array([20, -1])), "context_lens must be >= 0"),
    "table_too_narrow": (_edit("block_tables", lambda a: a[:, :2]), "needs 3 blocks"),
    "table_too_few_rows": (_edit("block_tables", lambda a: a[:1]), "a row per sequence"),
    "block_negative": (_edit("block_tables", lambda a: np.where(a == a[0, 1], -3, a)), r"block_tables\[0, 1\] = -3"),
    "block_too_big": (_edit("block_tables", lambda a: np.where(a == a[1, 0], 999, a)), r"block_tables\[1, 0\] = 999"),
    "context_lens_2d": (_edit("context_lens", lambda a: a[None]), "context_lens must be 1-D"),
}


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_errors(name):
    mutate, match = BAD_CASES[name]
    _bad(mutate, match)


def test_missing_extension_message(monkeypatch):
    from llmc.plugins.paged_attention import cpu

    monkeypatch.setattr(cpu, "_EXTENSION", "llmc.plugins.paged_attention._no_such_kernel")
    monkeypatch.setattr(cpu, "_kernel", None)
    with pytest.raises(ImportError, match="pip install \\."):
        cpu.load_kernel()
