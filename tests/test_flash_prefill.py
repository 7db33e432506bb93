"""The FlashAttention-2-style prefill kernel (plugins/paged_attention/flash.py, issue 51 item 4) against the reference.

Each case draws fresh random inputs (the seed is in each failure message) and runs the kernel under the Triton
interpreter through the CUDA session's own launch sequence (``flash_requests.run_attention``, with its tile
constexprs from ``flash_requests.requests``), holding it to the numpy reference (plugins/paged_attention/reference.py:
float32 there, and float64 for the attend_end cases, tests/test_attend_end.py's definition): the slots of this step
hold exactly what the reference wrote, no other cache byte changed, the outputs agree (tolerances of
tests/test_triton_paged_attention.py: float32 2e-5; 16-bit activations half an ulp of the output).

Steps mix decode rows, whole prompts and chunks after a cached prefix (contexts crossing many blocks: up to 19
blocks of 16), so each of the kernel's four loops runs (whole cached tiles unmasked, the prefix's partial tile, this
step's whole tiles before a tile's first query, the diagonal); GQA ratios 1/4/8, head sizes 64/128 (and 80, padded),
block sizes 16/32; every variant. Tiles are small (32 rows x 32 positions) to keep the interpreter at a few seconds
per case, except one case at the GPU's own tiling. Then the sm_90 AOT compile of the three kernels per variant, and
the CUDA engine's path: the compiler's attend_end attribute, its kernels, the session launching them (program input
8) and its plain-torch attention with attend_end.
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
SMALL = fr.Tiling(32, 32, 4, 1)  # 32 rows (tokens x group heads), 32 positions per step
SMALL_DECODE = fr.Tiling(16, 32, 4, 1)
# decode rows, a whole prompt, chunks after a cached prefix (the first crosses 19 blocks of 16), a one-token prompt
MIXED = [(300, 40), (150, 1), (37, 37), (260, 7), (1, 1), (90, 12)]


def fresh_rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


def run(case, seed, *, tiling=SMALL, act="fp32", **kw):
    """check_case with the flash kernels; the step is a prefill step (T != S) unless every sequence has one row."""
    record: dict = {}
    got, want = check_case(*case, seed=seed, atol=ATOL, act=act, kernel=flash_attention, prefill=tiling,
                           decode=SMALL_DECODE, record=record, **kw)
    return got, want, record["kernels"]


@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 4, 64, 16), (16, 4, 128, 32), (16, 2, 64, 16), (6, 2, 80, 32)],
                         ids=["gqa1-d64-bs16", "gqa4-d128-bs32", "gqa8-d64-bs16", "gqa3-d80-bs32"])
def test_mixed_prefill_and_decode(hq, hkv, d, bs):
    rng, seed = fresh_rng()
    _, _, kernels = run(make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=MIXED), seed)
    assert kernels.prefill.launches and not kernels.decode.launches  # a prefill step: one launch of one kernel
    (grid,) = kernels.prefill.launches
    total = sum(n for _, n in MIXED)
    assert grid == (-(-total // kernels.block_q) + len(MIXED), hkv, 1)


def test_gpu_tiling():
    """The tiling compiled for the GPU (128 rows: 32 tokens x 4 heads, 64 positions, prefill_tiling) on a chunk after
    a cached prefix."""
    rng, seed = fresh_rng()
    tiling = fr.prefill_tiling(64, 4)
    assert (tiling.block_m, tiling.block_n) == (128, 64)
    run(make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=[(200, 70), (65, 65)]), seed, tiling=tiling)


@pytest.mark.parametrize("act,cache", [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp16")])
def test_activation_and_cache_dtypes(act, cache):
    rng, seed = fresh_rng()
    with bf16_dot_as_on_gpu():
        run(make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED), seed, act=act, cache=cache)


@pytest.mark.parametrize("act", ["fp16", "bf16"])
def test_fp8_kv_cache(act):
    rng, seed = fresh_rng()
    # Scales that put the new K/V (|x| up to ~4.5) near the top of the E4M3 range, some beyond it (saturating).
    run(make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED), seed, act=act, fp8_scales=(0.009, 0.011))


@pytest.mark.parametrize("variant", ["window-softcap", "sinks", "alibi", "chunk", "window-sinks-alibi"])
def test_variants(variant):
    """Sliding window (smaller than a chunk, so whole cached tiles are skipped and window-masked), soft-capping,
    sinks, ALiBi (12 heads: slopes past the largest power of two), chunked local attention (chunks of 64 across the
    cached prefix and the step), and a mix."""
    rng, seed = fresh_rng()
    hq = 12 if "alibi" in variant else 8
    case = make_case(rng, hq=hq, hkv=4, d=64, bs=16, seqs=MIXED, q_scale=6.0 if "softcap" in variant else 1.0)
    attrs = case[2]
    if "window" in variant:
        attrs["sliding_window"] = 45
    if "softcap" in variant:
        attrs["softcap"] = 5.0
    if "sinks" in variant:
        attrs["sinks"] = (2 * rng.standard_normal(hq)).astype(np.float32)
    if "alibi" in variant:
        attrs["alibi_max_bias"] = 8.0
    if variant == "chunk":
        attrs["attention_chunk"] = 64
    run(case, seed)


def test_padding_rows_and_strided_views():
    """Trailing rows of no sequence keep what ``out`` held (zeros here) and write nothing; query, key and value as
    views of one packed QKV tensor (their rows strided, as the CUDA program hands them over): no copy needed, the
    same result."""
    rng, seed = fresh_rng()
    inputs, caches, attrs = make_case(rng, hq=8, hkv=2, d=64, bs=16, seqs=MIXED, pad_rows=3)
    got, _, _ = run((inputs, caches, attrs), seed)
    assert (got[-3:] == 0).all()
    t = inputs["query"].shape[0]
    qkv = torch.from_numpy(np.concatenate([inputs["query"], inputs["key"], inputs["value"]], axis=1))
    q, k, v = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=1)
    assert q.stride(0) == k.stride(0) == 12 * 64 and not k.is_contiguous()
    meta = {n: torch.from_numpy(inputs[n]) for n in ("slot_mapping", "block_tables", "context_lens",
                                                     "query_start_loc")}
    strided = flash_attention(q, k, v, *meta.values(), *(torch.from_numpy(c.copy()) for c in caches),
                              num_heads=8, num_kv_heads=2, scale=attrs["scale"], prefill=SMALL)
    assert strided.shape == (t, 8 * 64)
    np.testing.assert_array_equal(strided.numpy(), got)


# -------------------------------------------------------------------------------------------
# attend_end (bidirectional spans): the float64 definition of tests/test_attend_end.py


@pytest.mark.parametrize("window", [0, 5])
def test_attend_end_spans(window):
    """Spans at position 0, after a cached prefix, begun in the prefix, across blocks and row tiles (tests/
    test_attend_end.py's MIXED steps), with a window smaller than a span: the kernel = the reference = the
    definition."""
    from tests.test_attend_end import MIXED as SPANS
    from tests.test_attend_end import check_definition, make_step

    seed = int(np.random.SeedSequence().entropy % 2**32)
    inputs, caches, attrs = make_step(seed, SPANS, hq=8, hkv=2, d=32, bs=16, window=window, pad_rows=1)
    kernel_attrs = {**attrs, "attend_end": torch.from_numpy(attrs["attend_end"])}
    got, _, kernels = run((inputs, caches, kernel_attrs), seed)
    assert kernels.attend_end and kernels.prefill.request["constexprs"]["HAS_ATTEND_END"]
    check_definition(got[:-1], {k: (v[:-1] if k in ("query", "key", "value") else v) for k, v in inputs.items()},
                     caches, attrs, SPANS)


def test_cuda_torch_attention_takes_attend_end():
    """The CUDA engine's plain-torch attention (runtime/workers/cuda/ops.py, the fallback where no kernel was built)
    with attend_end = the reference, with and without a window, writing the reference's cache rows."""
    from llmc.runtime.workers.cuda.ops import paged_attention_torch
    from llmc.testing import attention_variants as av
    from tests.test_attend_end import MIXED as SPANS
    from tests.test_attend_end import check_definition, make_step

    for window in (0, 5):
        inputs, caches, attrs = make_step(7 + window, SPANS, hq=8, hkv=2, d=32, bs=16, window=window)
        av.check_torch_ops(inputs, caches, attrs, 8, 2, 32, custom_op_tail=(window, 0.0, None, 0.0, 0),
                           torch_kwargs={"sliding_window": window,
                                         "attend_end": torch.from_numpy(attrs["attend_end"])})
        t = {k: torch.from_numpy(v) for k, v in inputs.items()}
        k, v = (torch.from_numpy(c.copy()) for c in caches)
        got = paged_attention_torch(*t.values(), k, v, num_heads=8, num_kv_heads=2, scale=attrs["scale"],
                                    sliding_window=window, attend_end=torch.from_numpy(attrs["attend_end"]))
        check_definition(got.numpy(), inputs, caches, attrs, SPANS)


# -------------------------------------------------------------------------------------------
# The CUDA engine's path: compiler attribute, AOT kernels, the session launching them (program input 8)


def _one_attention_engine(tmp_path, hq, hkv, d, bs, node_attrs, sinks=None):
    """A one-node program (a PagedAttention node with attend_end as input 8) through the CUDA backend's emit (kernels
    compiled for sm_90), loaded by a CudaSession whose flash kernels run in the interpreter."""
    import onnx
    import onnx_ir as ir

    from llmc.compiler.backends import cuda
    from llmc.runtime.workers.cuda.session import CudaSession
    from llmc.testing.attention_variants import attention_graph

    model = ir.from_proto(onnx.load_from_string(
        attention_graph("PagedAttention", hq, hkv, d, node_attrs, sinks=sinks, attend_end=True)))
    out = tmp_path / "engine"
    out.mkdir()
    files = cuda.emit(model, out, sm=90, dtype="float32", block_size=bs)
    kv = {"num_layers": 1, "num_kv_heads": hkv, "block_size": bs, "head_size": d, "dtype": "float32"}
    manifest = {"engine": {"kernels": files.kernels}, "kv_cache": kv}
    session = CudaSession(out, manifest, device="cpu", interpret_kernels=True)
    return files, session, kv


def test_cuda_engine_passes_attend_end_to_its_flash_kernels(tmp_path):
    """compiler/backends/cuda.py marks the node has_attend_end (its input 8), compiles the flash kernels with
    HAS_ATTEND_END under an attention key of their own, and the session launches them with the program's
    attend_end: prefill and decode steps = the definition (the reference)."""
    from llmc.runtime.workers.cuda import program as torch_program
    from llmc.runtime.workers.cuda.session import attention_key
    from llmc.testing.attention_variants import run_reference
    from tests.test_attend_end import MIXED as SPANS
    from tests.test_attend_end import check_definition, make_step

    hq, hkv, d, bs = 8, 2, 32, 16
    files, session, kv = _one_attention_engine(tmp_path, hq, hkv, d, bs, {"scale": d ** -0.5})
    (node,) = torch_program.read_spec(tmp_path / "engine")["nodes"]
    assert node["attrs"]["has_attend_end"] == 1 and attention_key(node["attrs"]).endswith("-ae")
    attn = [k for k in files.kernels if k.get("op") == "paged_attention"]
    assert sorted(k["variant"] for k in attn) == sorted(fr.VARIANTS)
    assert all(k["key"] == attention_key(node["attrs"]) for k in attn)
    assert next(k for k in attn if k["variant"] == "flash-prefill")["config"]["HAS_ATTEND_END"]
    assert "attend_end_ptr" in next(k for k in attn if k["variant"] == "flash-prefill")["params"]

    for seqs in (SPANS, [(70, 1, []), (33, 1, []), (5, 1, [])]):  # a prefill step, then a decode step
        inputs, caches, attrs = make_step(3, seqs, hq=hq, hkv=hkv, d=d, bs=bs)
        pool = session.allocate_pool(kv, caches[0].shape[0])
        pool.layers[0][0].copy_(torch.from_numpy(caches[0]))
        pool.layers[0][1].copy_(torch.from_numpy(caches[1]))
        feeds = {k: torch.from_numpy(v) for k, v in inputs.items()}
        feeds["attend_end"] = torch.from_numpy(attrs["attend_end"])
        (got,) = session.program.run(feeds)
        check_definition(got.numpy(), inputs, caches, attrs, seqs)
        _, (k_ref, _) = run_reference(inputs, caches, attrs)
        np.testing.assert_array_equal(pool.layers[0][0].numpy(), k_ref)


# -------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU)


@pytest.mark.parametrize("variant", ["plain-bf16", "everything-fp8"])
def test_aot_for_sm90(variant):
    """The three kernels compile for sm_90a with exactly their launch parameters (Triton's hidden scratch pointers
    removed, the optional pointers where run_attention passes them), and ptxas accepts them; FP8 caches use the
    hardware E4M3 conversion."""
    import re

    from llmc.plugins import triton_aot
    from llmc.plugins.paged_attention import aot

    attrs = dict(num_heads=32, num_kv_heads=8, head_size=128, scale=128 ** -0.5)
    act, cache = "bf16", "bf16"
    if variant == "everything-fp8":
        attrs.update(sliding_window=512, softcap=30.0, has_sinks=1, has_attend_end=1, alibi_max_bias=8.0,
                     attention_chunk=1024)
        cache = "u8"
    reqs = fr.requests("k", attrs, act=act, cache=cache, block_size=16)
    compiled = triton_aot.compile_requests(list(reqs.values()), 90)
    for (name, req), k in zip(reqs.items(), compiled, strict=True):
        assert k["target"] == "sm_90a" and k["name"] == req["fn"]
        entry = re.search(rf"\.entry\s+{k['name']}\s*\((.*?)\)", k["ptx"], re.S).group(1)
        kinds = [p.split()[1] for p in entry.split(",") if p.strip()]
        params = fr.params(req)
        assert len(kinds) == len(params), (name, params)
        assert [i for i, t in enumerate(kinds) if t == ".u32"] == [i for i, p in enumerate(params)
                                                                  if req["signature"][p] == "i32"]
        assert ("sinks_ptr" in params) == (variant == "everything-fp8")
        if name == "flash-prefill":
            assert ("attend_end_ptr" in params) == (variant == "everything-fp8")
            assert params[-1] == "out_ptr" and params[-4:-1] == fr.STRIDES
        assert len(aot.assemble(k["ptx"], 90)) > 1000
        if cache == "u8" and name != "flash-reduce":
            assert "cvt.rn.f16x2.e4m3x2" in k["ptx"]
