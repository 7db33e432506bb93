"""Differential tests: the Triton PagedAttention kernel (run by the Triton interpreter) against the numpy reference.

Every case draws fresh random inputs (the seed is in each failure message): caches, queries, keys
and values from a normal distribution, block ids a random permutation of the pool, unused block
table columns -1. Each case runs the reference and the kernel on copies of the same caches and
checks that the slots of this step hold exactly what the reference wrote, that no other cache
byte changed, and that the outputs agree.

Tolerances: under the interpreter every dot product and the softmax run in float32 (numpy), so with
float32 activations the two sides differ only by summation order and the online softmax's
rescaling (a few ulps times a factor growing with the context; observed max |diff| < 1e-6, ATOL
2e-5 as in the CPU-kernel tests). With 16-bit activations both sides see identical inputs and the
kernel's only extra error is rounding its output to the activation dtype: half an ulp of values of
magnitude < 4, i.e. 2e-3 (float16) and 1.6e-2 (bfloat16). A wrong position, mask or head mapping
produces differences of order 1e-1.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does it too)
pytest.importorskip("triton", reason="triton is not installed: pip install '.[test]' (Linux wheels)")
torch = pytest.importorskip("torch")

from llmc.plugins.paged_attention import triton_kernel as tk  # noqa: E402
from llmc.quant.minifloat import E4M3  # noqa: E402
from llmc.testing.paged_attention import check_case, make_case  # noqa: E402

if not tk.interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process; the kernels would be "
                "compiled for a GPU (run this file on its own or through tests/conftest.py)", allow_module_level=True)

ATOL = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2}  # see the module docstring

MIXED = [(150, 1), (37, 37), (260, 7), (1, 1), (64, 1), (90, 12)]  # decode / whole prefill / chunks
DECODE = [(300, 1), (17, 1), (129, 1), (64, 1), (5, 1)]


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


# -------------------------------------------------------------------------------------------
# Shapes: every GQA ratio meets both head sizes and both block sizes across the two tests.


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 4, 64, 16), (8, 4, 128, 32), (8, 2, 64, 32), (16, 2, 128, 16)],
                         ids=["gqa1-d64-bs16", "gqa2-d128-bs32", "gqa4-d64-bs32", "gqa8-d128-bs16"])
def test_mixed_prefill_and_decode(hq, hkv, d, bs):
    rng, seed = fresh_rng()
    check_case(*make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=MIXED), seed=seed, atol=ATOL)


@pytest.mark.parametrize("hq,hkv,d,bs", [(2, 2, 128, 32), (4, 2, 64, 16), (8, 2, 128, 16), (8, 1, 64, 32)],
                         ids=["gqa1-d128-bs32", "gqa2-d64-bs16", "gqa4-d128-bs16", "gqa8-d64-bs32"])
def test_decode_batch(hq, hkv, d, bs):
    rng, seed = fresh_rng()
    check_case(*make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=DECODE), seed=seed, atol=ATOL)


@pytest.mark.parametrize("act,cache", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp16")])
def test_activation_and_cache_dtypes(act, cache):
    rng, seed = fresh_rng()
    check_case(*make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED), act=act, cache=cache, seed=seed, atol=ATOL)


def test_odd_group_and_head_size():
    """A GQA group of 3 (rows of a tile do not fill BLOCK_M) and a head size that is not a power of two."""
    rng, seed = fresh_rng()
    check_case(*make_case(rng, hq=6, hkv=2, d=80, bs=16, seqs=[(45, 3), (19, 1), (70, 30)]), seed=seed, atol=ATOL)


@pytest.mark.parametrize("act", ["fp16", "bf16"])
def test_fp8_kv_cache(act):
    rng, seed = fresh_rng()
    case = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED)
    # Scales that put the new K/V (|x| up to ~4.5) near the top of the E4M3 range, some beyond it (saturating).
    check_case(*case, act=act, fp8_scales=(0.009, 0.011), seed=seed, atol=ATOL)


def test_sliding_window_and_softcap():
    rng, seed = fresh_rng()
    case = make_case(rng, hq=8, hkv=4, d=64, bs=16, seqs=MIXED, q_scale=6.0)
    case[2].update(sliding_window=40, softcap=5.0)
    check_case(*case, seed=seed, atol=ATOL)


@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_split_kv(seqs):
    """Flash-decoding splits, with the sliding window (splits that see no position) and tiles unaligned to blocks."""
    rng, seed = fresh_rng()
    case = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=seqs)
    case[2].update(sliding_window=100)
    check_case(*case, seed=seed, atol=ATOL, num_splits=4, block_n=32)


def test_padding_rows_and_tile_sizes():
    """Trailing rows with slot -1 get zeros and write nothing; bigger query tiles than the block size."""
    rng, seed = fresh_rng()
    inputs, caches, attrs = make_case(rng, hq=4, hkv=2, d=64, bs=16, seqs=MIXED, pad_rows=3)
    got, _ = check_case(inputs, caches, attrs, seed=seed, atol=ATOL, block_m=32, block_n=64)
    assert (got[-3:] == 0).all()


def test_int32_metadata():
    rng, seed = fresh_rng()
    inputs, caches, attrs = make_case(rng, hq=4, hkv=2, d=64, bs=16, seqs=[(33, 2), (9, 1)])
    for name in ("slot_mapping", "block_tables", "context_lens", "query_start_loc"):
        inputs[name] = inputs[name].astype(np.int32)
    check_case(inputs, caches, attrs, seed=seed, atol=ATOL)


# -------------------------------------------------------------------------------------------
# FP8 codec


def test_fp8_codec_matches_e4m3():
    """The kernel's encoder (x / scale -> code) and decoder agree with the project's E4M3 codec bit for bit."""
    rng, seed = fresh_rng()
    grid = E4M3.table[np.isfinite(E4M3.table)]
    mids = (np.sort(grid)[1:] + np.sort(grid)[:-1]) / 2  # exact ties: round half to even
    specials = np.array([0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 1e6, -1e6, np.inf, -np.inf, 2.0**-9, 2.0**-10,
                         3 * 2.0**-11, 2.0**-6, 2.0**-6 * 0.999, 1e-30], dtype=np.float32)
    x = np.concatenate([grid, mids, specials, rng.standard_normal(4000) * 50, rng.standard_normal(2000) * 0.01]
                       ).astype(np.float32)
    scale = 0.75
    codes_in = np.arange(256, dtype=np.uint8)
    codes_in = np.resize(codes_in, x.shape)
    codes, decoded = tk.fp8_codec(torch.from_numpy(x), torch.from_numpy(codes_in), scale)
    np.testing.assert_array_equal(codes.numpy(), E4M3.encode(x / np.float32(scale)), err_msg=f"seed={seed}")
    want = E4M3.decode(codes_in)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(decoded.float().numpy()[finite], want[finite])
    nan_codes = (codes_in & 0x7F) == 0x7F
    assert np.isnan(decoded.float().numpy()[nan_codes]).all()


def test_num_splits_heuristic():
    assert tk.choose_num_splits(num_seqs=64, num_kv_heads=8, max_context_len=32768, num_sms=132) == 1
    assert tk.choose_num_splits(num_seqs=1, num_kv_heads=8, max_context_len=32768, num_sms=132) == 32
    assert tk.choose_num_splits(num_seqs=1, num_kv_heads=8, max_context_len=512, num_sms=132) == 2
    assert tk.choose_num_splits(num_seqs=1, num_kv_heads=8, max_context_len=100, num_sms=132) == 1
