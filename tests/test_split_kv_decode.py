"""Split-KV (flash-decoding) decode attention (plugins/paged_attention/flash.py, issue 51 item 4) against the reference.

Decode steps (one new row per sequence) through the CUDA session's launch sequence
(``flash_requests.run_attention``: the split-KV kernel, then the reduce kernel when it splits) under the Triton
interpreter, on fresh random inputs (the seed is in each failure message), held to the numpy reference as
tests/test_flash_prefill.py holds the prefill kernel (same tolerances): split counts 1 to 8 over contexts shorter
than one split, a few splits and many blocks (a small least split length, so the interpreter stays at seconds),
GQA 1/4/8, head sizes 64/128, block sizes 16/32, every variant (a window that leaves splits empty, sinks joined in
the reduce, ALiBi, chunks, soft-capping, FP8 caches, 16-bit activations). Then the split rule (shapes only: what
a captured CUDA graph needs), empty splits never read, and the CUDA engine launching these kernels (the Triton
interpreter standing in for the driver) = the same program on plain torch ops.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py does it too)
pytest.importorskip("triton", reason="triton is not installed: pip install '.[test]' (Linux wheels)")
torch = pytest.importorskip("torch")

from llmc.plugins.fused.interpreter import bf16_dot_as_on_gpu  # noqa: E402
from llmc.plugins.paged_attention import flash_requests as fr  # noqa: E402
from llmc.plugins.paged_attention import triton_kernel as tk  # noqa: E402
from llmc.testing.paged_attention import check_case, flash_attention, make_case  # noqa: E402

if not tk.interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set in this process", allow_module_level=True)

ATOL = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2}
DECODE_TILE = fr.Tiling(16, 32, 4, 1)
MIN_SPLIT = 32  # positions: contexts of 5-300 then span 1 to 10 splits
# contexts shorter than a tile, than a split, a split and a bit, across many blocks (19 of 16), a one-token prompt
DECODE = [(300, 1), (17, 1), (129, 1), (5, 1), (64, 1), (1, 1)]


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def run(case, seed, num_splits, *, act="fp32", **kw):
    record: dict = {}
    got, want = check_case(*case, seed=seed, atol=ATOL, act=act, kernel=flash_attention, decode=DECODE_TILE,
                           num_splits=num_splits, min_split=MIN_SPLIT, record=record, **kw)
    return got, want, record["kernels"]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 8])
def test_split_counts(num_splits):
    """Each split count: one launch of the decode kernel over (S, Hkv, splits), plus the reduce past one split."""
    rng, seed = fresh_rng()
    _, _, kernels = run(make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=DECODE), seed, num_splits)
    assert kernels.decode.launches == [(len(DECODE), 2, num_splits)]
    assert kernels.reduce.launches == ([] if num_splits == 1 else [(len(DECODE), 8, 1)])
    assert not kernels.prefill.launches


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 4, 128, 32), (16, 4, 64, 16), (16, 2, 128, 16), (6, 2, 80, 32)],
                         ids=["gqa1-d128-bs32", "gqa4-d64-bs16", "gqa8-d128-bs16", "gqa3-d80-bs32"])
def test_shapes(hq, hkv, d, bs):
    rng, seed = fresh_rng()
    run(make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=DECODE), seed, 4)


@pytest.mark.parametrize("variant", ["window", "sinks", "alibi", "chunk", "softcap", "window-sinks-alibi"])
def test_variants(variant):
    """Split 4 ways: a window of 40 (the rows' spans shorter than the splits': some splits empty), sinks (joined in
    the reduce, once), ALiBi (12 heads), chunks of 48 (the span starts mid-context), soft-capping, a mix."""
    rng, seed = fresh_rng()
    hq = 12 if "alibi" in variant else 8
    case = make_case(rng, hq=hq, hkv=4, d=64, bs=16, seqs=DECODE, q_scale=6.0 if variant == "softcap" else 1.0)
    attrs = case[2]
    if "window" in variant:
        attrs["sliding_window"] = 40
    if "sinks" in variant:
        attrs["sinks"] = (2 * rng.standard_normal(hq)).astype(np.float32)
    if "alibi" in variant:
        attrs["alibi_max_bias"] = 8.0
    if variant == "chunk":
        attrs["attention_chunk"] = 48
    if variant == "softcap":
        attrs["softcap"] = 5.0
    for splits in (1, 4):
        run(case, seed, splits)


@pytest.mark.parametrize("act", ["fp16", "bf16"])
def test_fp8_kv_cache(act):
    rng, seed = fresh_rng()
    case = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=DECODE)
    with bf16_dot_as_on_gpu():
        run(case, seed, 3, act=act, fp8_scales=(0.009, 0.011))


@pytest.mark.parametrize("act,cache", [("fp16", "fp16"), ("bf16", "bf16")])
def test_16_bit_activations(act, cache):
    rng, seed = fresh_rng()
    with bf16_dot_as_on_gpu():
        run(make_case(rng, hq=8, hkv=2, d=128, bs=16, seqs=DECODE), seed, 4, act=act, cache=cache)


def test_gpu_tiling_and_split_rule():
    """The GPU's decode tiling (64-position tiles) and its split rule's count for this batch, on a long context."""
    rng, seed = fresh_rng()
    inputs, caches, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=[(700, 1), (40, 1)])
    record: dict = {}
    check_case(inputs, caches, attrs, seed=seed, atol=ATOL, kernel=flash_attention, record=record)
    splits = fr.decode_num_splits(2, 2, inputs["block_tables"].shape[1] * 16, 132)
    assert splits == 3  # cdiv(46 blocks x 16 positions, 256)
    assert record["kernels"].decode.launches == [(2, 2, splits)]


def test_empty_splits_are_never_read():
    """Partials start as NaN: splits past a sequence's own count (a 5-token context in an 8-way launch) write
    nothing and the reduce reads nothing of them (a NaN would reach the output)."""
    rng, seed = fresh_rng()
    inputs, caches, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=[(5, 1), (300, 1), (33, 1)])
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    k, v = (torch.from_numpy(c.copy()) for c in caches)
    got = fr.run_attention(fr.jit_kernels({**attrs, "head_size": 64}, act="fp32", cache="fp32", block_size=16,
                                          decode=DECODE_TILE, min_split=MIN_SPLIT),
                           t["query"], t["key"], t["value"], t["slot_mapping"], t["block_tables"], t["context_lens"],
                           t["query_start_loc"], k, v, torch.ones(2), num_sms=132, num_splits=8,
                           new=lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
    from llmc.testing.attention_variants import run_reference

    want, _ = run_reference(inputs, caches, attrs)
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5, err_msg=f"seed={seed}")


def test_split_rule():
    """Shapes only (the batch and the block table's width: fixed per captured CUDA graph), about 4 programs per SM,
    slices of at least MIN_SPLIT_LEN positions, at most MAX_SPLITS. Llama-3.2-1B (8 KV heads) on an H100 (132 SMs):
    batch 1 at 4k: 16 splits (128 programs of 256 positions), at 32k: 64 (512 programs of 512); batch 8 at 4k: 8;
    batch 64: none (512 programs already)."""
    rule = fr.decode_num_splits
    assert rule(1, 8, 4096, 132) == 16 and rule(1, 8, 32768, 132) == 64
    assert rule(8, 8, 4096, 132) == 8 and rule(8, 8, 32768, 132) == 8
    assert rule(64, 8, 4096, 132) == 1 and rule(256, 8, 512, 132) == 1
    assert rule(1, 8, 100, 132) == 1  # shorter than one slice
    assert rule(1, 1, 1 << 20, 132) == fr.MAX_SPLITS


# -------------------------------------------------------------------------------------------
# The CUDA engine launching the flash kernels


def test_engine_launch_path_on_cpu_matches_the_torch_ops(tiny_cuda_engine):
    """The CUDA engine with its flash attention (prefill, split-KV decode + reduce) and fused kernels launched by
    the session as on a GPU (the Triton interpreter instead of the driver), against the same program on plain torch
    ops: scores of a 12-token prompt (prefill) and greedy tokens (prefill, then decode steps: split-KV over the
    session's split count)."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.artifact import read_manifest
    from llmc.runtime.workers.cuda.session import CudaSession

    # the tiny checkpoint's H100 engine in float32, its AOT kernels compiled: the session's (tests/conftest.py)
    manifest = read_manifest(tiny_cuda_engine)
    variants = {k["variant"] for k in manifest["engine"]["kernels"] if k.get("op") == "paged_attention"}
    assert variants == set(fr.VARIANTS)
    eng = Engine.load(tiny_cuda_engine, device="cpu")
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    ids = [int(x) for x in rng.integers(3, eng.vocab_size, 12)]
    plain_tokens = eng.generate([ids[:9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    plain = eng.score(ids)
    session = CudaSession(tiny_cuda_engine, eng.manifest, device="cpu", interpret_kernels=True)
    assert session._flash  # the attention configurations run the flash kernels
    launched = []
    for kernel in session.kernels.values():
        original = kernel.launch

        def counted(grid, args, stream, original=original, name=kernel.info.name):
            launched.append((name, tuple(grid)))
            return original(grid, args, stream)

        kernel.launch = counted
    eng._pool = eng._stepper.pool = session.allocate_pool(eng.manifest["kv_cache"], eng._blocks.num_blocks)
    eng._session = eng._stepper.session = session  # score() runs the engine's session, generate() its stepper's
    np.testing.assert_allclose(eng.score(ids), plain, atol=1e-4, rtol=0)
    assert {n for n, _ in launched} >= {"flash_prefill_kernel"}
    launched.clear()
    assert eng.generate([ids[:9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == plain_tokens
    names = [n for n, _ in launched]
    assert "flash_prefill_kernel" in names and "split_kv_decode_kernel" in names
