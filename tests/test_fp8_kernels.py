"""The kernels that emit FP8 linears' inputs (RMSNorm / skip-RMSNorm / SwiGLU -> E4M3 with a static scale, and the
standalone quantize kernel) against the torch ops, under the Triton interpreter; their AOT compilation; and the FP8
CUDA engine's launch path (kernels interpreted, ``torch._scaled_mm`` with the scales folded at load) against the same
program on plain torch ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.plugins.fused import fp8_kernels as f8
from llmc.plugins.fused import triton_kernels as tk
from llmc.runtime.workers.cuda.ops import OPS, fp8_codes

SCALE = torch.tensor([0.01], dtype=torch.float32)  # small: some codes saturate at ±448


def _rand(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("skip", [False, True])
def test_rms_norm_fp8_kernel_quantizes_what_the_norm_computes(dtype, skip):
    rows, n = 5, 200
    x, res = _rand(1, rows, n, dtype=dtype), _rand(1, rows, n, dtype=dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    low = dtype != torch.float32
    codes, total = torch.empty(x.shape, dtype=torch.uint8), torch.empty_like(x)
    f8.rms_norm_fp8_kernel[(rows,)](x, res, w, SCALE, codes, total, rows, N=n, BLOCK=256, EPS=1e-5, HAS_SKIP=skip,
                                    ROUND_Y=low)
    act, total2 = torch.empty_like(x), torch.empty_like(x)
    tk.rms_norm_kernel[(rows,)](x, res, w, act, total2, rows, N=n, BLOCK=256, EPS=1e-5, HAS_SKIP=skip, ROUND_Y=low)
    # exactly the codes of what the plain norm kernel writes
    assert torch.equal(codes, fp8_codes(act, SCALE).view(torch.uint8))
    if skip:
        want, want_total = OPS["SkipRMSNormalization"](x, res, w, SCALE, epsilon=1e-5)
        assert torch.equal(total, want_total)
    else:
        (want,) = OPS["RMSNormalization"](x, w, SCALE, epsilon=1e-5)
    if not low:  # float32: the torch op's codes bit for bit
        assert torch.equal(codes, want.view(torch.uint8))
    else:  # the norm's last fp16 bit may differ (summation order): then the neighbouring code, same sign
        step = (codes.to(torch.int16) - want.view(torch.uint8).to(torch.int16)).abs()
        assert int(step.max()) <= 1 and (step == 0).float().mean() > 0.8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_fp8_kernel_on_split_views_equals_the_torch_op(dtype):
    rows, n = 4, 96
    gate, up = torch.split(_rand(1, rows, 2 * n, dtype=dtype), [n, n], dim=-1)
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    codes = torch.empty(gate.shape, dtype=torch.uint8)
    f8.swiglu_fp8_kernel[(rows, 1)](g2, u2, SCALE, codes, rows, g2.stride(0), u2.stride(0), N=n, BLOCK=128)
    (want,) = OPS["SwiGLU"](gate, up, SCALE)
    assert want.dtype == torch.float8_e4m3fn
    assert torch.equal(codes, want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_quantize_kernel_is_the_quantize_expression_bit_for_bit(dtype):
    x = _rand(6, 40, dtype=dtype)[:, :37]  # strided rows
    x[0, :6] = torch.tensor([1e6, -1e6, float("nan"), 0.0, -0.0, 2 ** -12])
    codes = torch.empty(x.shape, dtype=torch.uint8)
    f8.fp8_quantize_kernel[(6, 1)](x, SCALE, codes, 6, x.stride(0), N=37, BLOCK=64)
    assert torch.equal(codes, fp8_codes(x, SCALE).view(torch.uint8))


def test_fp8_kernels_compile_ahead_of_time():
    from llmc.plugins import triton_aot
    from llmc.plugins.fused import requests

    reqs = [requests.rms_norm_fp8_request(2048, 1e-5, True, "bf16", "bf16"), requests.swiglu_fp8_request(8192, "bf16"),
            requests.fp8_quantize_request(2048, "bf16")]
    for req, k in zip(reqs, triton_aot.compile_requests(reqs, 90), strict=True):
        entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
        visible = [n for n, t in req["signature"].items() if t != "constexpr"]
        assert entry.count(".param") == len(visible), (req["fn"], entry)
        assert k["target"].startswith("sm_90")


def test_fp8_engine_kernel_launch_path_on_cpu_matches_the_torch_ops(tmp_path, tiny_llama):
    """The FP8 CUDA engine as a GPU runs it (the norm / SwiGLU kernels emitting codes, the quantize kernel before the
    other linears, one ``torch._scaled_mm`` each with the activation scale folded into the weight's at load) against
    the same program on plain torch ops (the emulated products)."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.workers.cuda.session import CudaSession

    recipe = QuantRecipe(quant="fp8", calib_samples=4, calib_seq_len=32, embeddings="none", lm_head="none")
    built = build(tiny_llama, tmp_path / "g", BuildOptions(target="h100", dtype="float32", quant=recipe))
    ops = {k["op"] for k in built.manifest["engine"]["kernels"] if k["variant"] == "fused"}
    assert {"rms_norm_fp8", "swiglu_fp8", "fp8_quantize"} <= ops, ops
    eng = Engine.load(built.out_dir, device="cpu")
    ids = np.random.default_rng().integers(3, eng.vocab_size, 10).tolist()
    plain = eng.score(ids)
    plain_tokens = eng.generate([ids[:6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    plain_steps = eng.score(ids[:6] + plain_tokens)[5:]  # row k: the logits that chose plain_tokens[k]
    session = CudaSession(built.out_dir, eng.manifest, device="cpu", interpret_kernels=True)
    eng._pool = session.allocate_pool(eng.manifest["kv_cache"], eng._blocks.num_blocks)
    eng._session = session
    got = eng.score(ids)
    # Same codes, so the same logits to float rounding (the products summed by _scaled_mm and scaled once by
    # (activation x weight) scale instead of twice). That rounding can move one activation across an E4M3 rounding
    # boundary: one code one step away, and every later position reading it through the KV cache. Measured over 300
    # random prompts: 95% equal to 1e-4 of the logits' range, the rest within 5.1% of it (mean 3.7% of the mean |logit|
    # at worst); the activation scale 6% off in the kernels moves them by 22-37% of it (mean 18-20%).
    top, diff = np.abs(plain).max(), np.abs(got - plain)
    assert diff.max() <= 0.1 * top and diff.mean() <= 0.06 * np.abs(plain).mean(), (diff.max() / top, diff.mean())
    tokens = eng.generate([ids[:6]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    k = next((i for i, (a, b) in enumerate(zip(tokens, plain_tokens, strict=True)) if a != b), None)
    if k is not None:  # greedy paths part only where the plain engine's top two were within such a flip's reach
        assert plain_steps[k, plain_tokens[k]] - plain_steps[k, tokens[k]] <= 0.1 * top, (k, tokens, plain_tokens)
