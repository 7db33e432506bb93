"""The grouped MXFP4 expert kernel (plugins/mxfp4/triton_kernel.py) against the numpy reference of the op.

Each case runs the CUDA session's own launch code (``FusedOps.mxfp4_moe``: the sort of the expert ids, which tiling,
the grid) with the kernel under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on fresh random
E2M1 codes (all 16 codes) and E8M0 exponents drawn from a band (tiny, a checkpoint's, large), routed top-k > 1 from
random router logits (so some experts get no rows), and once with every row on one expert (several row blocks of
it); float32 to the float32 sums' rounding, bfloat16 (its weights decode exactly) to one rounding of the output.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.plugins.mxfp4 import reference
from llmc.plugins.mxfp4 import requests as mk
from llmc.runtime.workers.cuda.fused_ops import FusedOps
from llmc.runtime.workers.cuda.kernels import InterpretedKernel, KernelInfo
from llmc.runtime.workers.cuda.ops import OPS

_TL = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# E8M0 exponent bands: tiny weights (2^-127.. incl. the subnormal 2^-127 of exponent 0), a checkpoint's (gpt-oss:
# about 2^-10 .. 2^2), large ones
BANDS = {"tiny": (0, 12), "checkpoint": (112, 132), "large": (140, 160)}


@pytest.fixture(autouse=True)
def _bf16_dot():
    """The interpreter's tl.dot over bfloat16 multiplies bit patterns (plugins/fused/interpreter.py): as a GPU."""
    from llmc.plugins.fused.interpreter import bf16_dot_as_on_gpu

    with bf16_dot_as_on_gpu():
        yield


def _ops(e: int, n: int, k: int, dtype: torch.dtype, log: list) -> tuple[FusedOps, str]:
    """FusedOps with both tilings of one expert weight loaded as interpreted kernels, as the session loads them."""
    kernels = {}
    for wide in (False, True):
        req = mk.moe_request(e, n, k, _TL[dtype], wide=wide)
        info = KernelInfo(name=req["fn"], file="", sm=90, num_warps=req["num_warps"], shared_mem=0, block_q=0,
                          num_kv_heads=0, variant="fused", key=req["key"], config=req["constexprs"])
        kernels[req["key"]] = InterpretedKernel(info, {"module": req["module"], "fn": req["fn"],
                                                       "config": req["constexprs"]})

    def launch(kernel, grid, args):
        log.append((kernel.info.key, grid))
        kernel.launch(grid, args, 0)

    return FusedOps(kernels.get, launch, dtype, torch.device("cpu")), mk.moe_request(e, n, k, _TL[dtype])["key"]


def _routed(rng, tokens: int, e: int, top_k: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as the program hands them: each token's row repeated top-k times, ids ``[rows, 1]`` from top-k logits."""
    logits = rng.standard_normal((tokens, e))
    ids = np.argsort(-logits, axis=1)[:, :top_k].reshape(-1, 1).astype(np.int64)
    x = np.repeat(rng.standard_normal((tokens, k)).astype(np.float32), top_k, axis=0)
    return x[:, None, :], ids


def _check(got: torch.Tensor, x: torch.Tensor, ids: np.ndarray, blocks: np.ndarray, scales: np.ndarray,
           dtype: torch.dtype) -> None:
    want = reference.mxfp4_moe_matmul(x.float().numpy(), ids, blocks, scales)  # x as rounded to dtype
    assert got.dtype == dtype and tuple(got.shape) == want.shape
    scale = float(np.abs(want).max())
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.float().numpy(), want, rtol=tol, atol=tol * scale)


# bfloat16 leaves out the tiny band: its products are float32 subnormals, which a bfloat16 MMA need not keep
@pytest.mark.parametrize(("dtype", "band"), [(torch.float32, b) for b in sorted(BANDS)]
                         + [(torch.bfloat16, b) for b in sorted(BANDS) if b != "tiny"])
@pytest.mark.parametrize(("e", "n", "k", "tokens", "top_k"), [(8, 48, 96, 1, 2), (8, 48, 96, 19, 2),
                                                              (4, 130, 128, 75, 4), (6, 64, 64, 300, 3)])
def test_grouped_kernel_equals_the_reference(dtype, band, e, n, k, tokens, top_k):
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(*BANDS[band], (e, n, k // 32)).astype(np.uint8)
    x_np, ids = _routed(rng, tokens, e, top_k, k)
    x = torch.from_numpy(x_np).to(dtype)
    log: list = []
    ops, key = _ops(e, n, k, dtype, log)
    (got,) = ops.mxfp4_moe(x, torch.from_numpy(ids), torch.from_numpy(blocks), torch.from_numpy(scales), kernel=key)
    rows = tokens * top_k
    assert [r[0] for r in log] == [key + (mk.WIDE_SUFFIX if rows > 16 * e else "")]  # the kernel ran, no fallback
    _check(got, x, ids, blocks, scales, dtype)
    if band == "checkpoint":  # the torch op (each row's expert gathered and decoded) agrees where both are exact
        (plain,) = OPS["Mxfp4MoEMatMul"](x, torch.from_numpy(ids), torch.from_numpy(blocks), torch.from_numpy(scales))
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol * float(plain.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_with_many_row_blocks_and_a_strided_x(dtype):
    """Every row on expert 2 of 5 (the others empty): 37 rows are three 16-row blocks of one expert; x a column
    slice of a wider tensor."""
    rng = np.random.default_rng()
    e, n, k = 5, 72, 64
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(*BANDS["checkpoint"], (e, n, k // 32)).astype(np.uint8)
    wide = torch.from_numpy(rng.standard_normal((37, 1, k + 16)).astype(np.float32)).to(dtype)
    x = wide[..., 16:]
    ids = np.full((37, 1), 2, np.int64)
    log: list = []
    ops, key = _ops(e, n, k, dtype, log)
    (got,) = ops.mxfp4_moe(x, torch.from_numpy(ids), torch.from_numpy(blocks), torch.from_numpy(scales), kernel=key)
    assert log == [(key, (-(-n // mk.DECODE_BLOCK_N), 3 + e, 1))]
    _check(got, x, ids, blocks, scales, dtype)


def test_the_layer_sorts_its_ids_once():
    """gate/up and down route the same ids: one torch.sort for both; new ids are sorted afresh."""
    rng = np.random.default_rng()
    e, n, k = 4, 64, 64
    blocks = torch.from_numpy(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 126, (e, n, k // 32)).astype(np.uint8))
    ops, key = _ops(e, n, k, torch.float32, [])
    x_np, ids_np = _routed(rng, 6, e, 2, k)
    x, ids = torch.from_numpy(x_np), torch.from_numpy(ids_np)
    sorts = []
    original = torch.sort
    try:
        torch.sort = lambda *a, **kw: sorts.append(1) or original(*a, **kw)
        first = ops.mxfp4_moe(x, ids, blocks, scales, kernel=key)[0]
        second = ops.mxfp4_moe(first, ids, blocks, scales, kernel=key)[0]
        assert len(sorts) == 1
        x2_np, ids2_np = _routed(rng, 6, e, 2, k)
        third = ops.mxfp4_moe(torch.from_numpy(x2_np), torch.from_numpy(ids2_np), blocks, scales, kernel=key)[0]
        assert len(sorts) == 2
    finally:
        torch.sort = original
    for got, xx, ii in ((first, x, ids_np), (second, first, ids_np), (third, torch.from_numpy(x2_np), ids2_np)):
        _check(got, xx, ii, blocks.numpy(), scales.numpy(), torch.float32)


def test_both_tilings_compile_ahead_of_time():
    from llmc.plugins import triton_aot

    reqs = [mk.moe_request(32, 5760, 2880, "bf16", wide=w) for w in (False, True)]  # gpt-oss-20b's gate/up
    for req, k in zip(reqs, triton_aot.compile_requests(reqs, 90), strict=True):
        entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
        assert entry.count(".param") == 9, (req["key"], entry)  # the visible parameters only
        assert k["target"].startswith("sm_90") and k["shared_mem"] <= 100 * 1024


def test_gpt_oss_cuda_engine_with_the_kernel_launched_matches_the_torch_program(tmp_path):
    """The tiny MXFP4 gpt-oss built for the GPU (float32), its grouped expert kernels launched by the session under
    the interpreter (as on a GPU, minus the driver), against the same program on plain torch ops: a prompt's
    log-probabilities (prefill: many rows per expert) and greedy decode tokens (a few rows per step)."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.workers.cuda.session import CudaSession
    from tests.test_prequantized_mxfp4 import write_mxfp4_fixture

    built = build(write_mxfp4_fixture(tmp_path), tmp_path / "engine", BuildOptions(target="h100", dtype="float32"))
    assert sum(k.get("op") == "mxfp4_moe" for k in built.manifest["engine"]["kernels"]) == 4  # 2 weights x 2 tilings
    eng = Engine.load(built.out_dir, device="cpu")
    ids = np.random.default_rng().integers(3, eng.vocab_size, 40).tolist()
    plain = eng.score(ids)
    plain_tokens = eng.generate([ids[:9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    session = CudaSession(built.out_dir, eng.manifest, device="cpu", interpret_kernels=True)
    launched: list = []
    for kernel in session.kernels.values():  # what the session launches, recorded on the way to the interpreter
        kernel.launch = (lambda run, key: lambda grid, args, stream: (launched.append(key), run(grid, args, stream)))(
            kernel.launch, kernel.info.key)
    eng._pool = eng._stepper.pool = session.allocate_pool(eng.manifest["kv_cache"], eng._blocks.num_blocks)
    eng._session = eng._stepper.session = session  # score() runs the engine's session, generate() its stepper's
    np.testing.assert_allclose(eng.score(ids), plain, atol=1e-4, rtol=0)
    assert eng.generate([ids[:9]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids == plain_tokens
    assert any(k.startswith("mxfp4_moe") and k.endswith(mk.WIDE_SUFFIX) for k in launched)  # 40 x 2 rows, 4 experts
    assert any(k.startswith("mxfp4_moe") and not k.endswith(mk.WIDE_SUFFIX) for k in launched)
