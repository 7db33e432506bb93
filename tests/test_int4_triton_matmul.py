"""The W4A16 Triton kernel (plugins/fused/triton_kernels.py ``int4_matmul_kernel``) at every row count.

Each case runs the CUDA session's own launch code (``FusedOps.int4_linear``: which tiling, grid, split-K, strides)
with the kernel under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on fresh random weights
quantized RTN (signed codes, no zero points) and asymmetric (zero points: AWQ / GPTQ's form), against the torch op
that dequantizes the weight (``OPS["Int4Linear"]``): equal up to the order of the float32 sums (float32), or to one
rounding of the bfloat16 output (the interpreter's bfloat16 dot fixed to multiply values,
plugins/fused/interpreter.py). The decode tiling must serve up to 16 rows and the wide one every row count past it,
with no fallback to the torch op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.plugins.fused import requests
from llmc.runtime.workers.cuda.fused_ops import FusedOps
from llmc.runtime.workers.cuda.kernels import InterpretedKernel, KernelInfo
from llmc.runtime.workers.cuda.ops import OPS

_TL = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@pytest.fixture(autouse=True)
def _bf16_dot():
    """The interpreter's tl.dot over bfloat16 multiplies bit patterns (plugins/fused/interpreter.py): as a GPU."""
    from llmc.plugins.fused.interpreter import bf16_dot_as_on_gpu

    with bf16_dot_as_on_gpu():
        yield


def _weights(n: int, k: int, g: int, symmetric: bool, dtype: torch.dtype, rng):
    from llmc.compiler.backends.cuda import _pack_int4
    from llmc.passes.quantize import _int4_arrays
    from llmc.quant import int4

    q = int4.quantize_rtn(rng.standard_normal((n, k)).astype(np.float32), g, symmetric)
    codes, scales, *zp = _int4_arrays(q, "qdq")
    packed = torch.from_numpy(_pack_int4(codes))
    s = torch.from_numpy(scales).to(dtype)
    z = torch.from_numpy(zp[0].astype(np.uint8)) if zp else None
    return packed, s, z


def _fused_ops(n: int, k: int, g: int, has_zero: bool, dtype: torch.dtype, log: list) -> tuple[FusedOps, str]:
    """FusedOps with both tilings of one linear loaded as interpreted kernels, as the session loads them."""
    kernels = {}
    for wide in (False, True):
        req = requests.int4_matmul_request(n, k, g, has_zero, _TL[dtype], wide=wide)
        info = KernelInfo(name=req["fn"], file="", sm=90, num_warps=req["num_warps"], shared_mem=0, block_q=0,
                          num_kv_heads=0, variant="fused", key=req["key"], config=req["constexprs"])
        kernels[req["key"]] = InterpretedKernel(info, {"module": req["module"], "fn": req["fn"],
                                                       "config": req["constexprs"]})

    def launch(kernel, grid, args):
        log.append((kernel.info.key, grid, args[8]))
        kernel.launch(grid, args, 0)

    key = requests.int4_matmul_request(n, k, g, has_zero, _TL[dtype])["key"]
    return FusedOps(kernels.get, launch, dtype, torch.device("cpu")), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False], ids=["rtn-signed", "zero-points"])
@pytest.mark.parametrize("n,k,g", [(130, 256, 32), (96, 200, 64), (64, 512, 128)])
def test_int4_linear_kernel_equals_the_torch_op_at_every_row_count(dtype, symmetric, n, k, g):
    rng = np.random.default_rng()
    packed, s, z = _weights(n, k, g, symmetric, dtype, rng)
    log: list = []
    ops, key = _fused_ops(n, k, g, z is not None, dtype, log)
    for m in (1, 16, 17, 64, 300):
        # x as the program hands it: a column slice of a wider activation (rows k + 24 apart)
        wide = torch.from_numpy(rng.standard_normal((1, m, k + 24)).astype(np.float32)).to(dtype)
        x = wide[..., 8: 8 + k]
        (want,) = OPS["Int4Linear"](x, packed, s, z, group_size=g, k=k)
        (got,) = ops.int4_linear(x, packed, s, z, kernel=key, group_size=g, k=k)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape == (1, m, n)
        ran, grid, split = log[-1]
        assert ran == key + ("" if m <= requests.INT4_BLOCK_M else requests.INT4_WIDE_SUFFIX), (m, ran)
        assert grid[1] == split and grid[2] == -(-m // (requests.INT4_BLOCK_M if m <= 16 else
                                                       requests.INT4_WIDE_BLOCK_M))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        else:  # the same products, summed in another order, then rounded to bfloat16 (the torch op rounds too)
            scale = float(want.float().abs().max())
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2 * scale)
    assert len(log) == 5  # every row count ran the kernel (no torch fallback)


def test_split_k_fills_the_gpu_and_covers_k_once():
    """The launch rule: every K block in exactly one split, the split a power of two no larger than two programs
    per SM ask for, and its float32 partials at most half the packed weight's bytes; prefill chunks do not split."""
    for n, k, g in ((2048, 2048, 128), (3072, 2048, 128), (16384, 2048, 128), (2048, 8192, 128), (130, 256, 32)):
        for wide in (False, True):
            cfg = requests.int4_matmul_request(n, k, g, False, "bf16", wide=wide)["constexprs"]
            for rows in ((1, 4, 16) if not wide else (17, 32, 64, 512, 2048)):
                grid, split, chunk = requests.int4_launch(cfg, rows)
                assert chunk % cfg["BLOCK_K"] == 0 and (split - 1) * chunk < k <= split * chunk
                assert grid[0] * grid[1] * grid[2] <= max(2 * requests.INT4_NUM_SMS, grid[0] * grid[2])
                assert split == 1 or split * rows * n * 8 <= k * n / 2 * 1.01
                if rows >= 512:
                    assert split == 1
    # the 1B shape's o_proj at batch 1 does split (K 2048 over 32 column tiles: 8 splits of 256)
    cfg = requests.int4_matmul_request(2048, 2048, 128, False, "bf16")["constexprs"]
    assert requests.int4_launch(cfg, 1)[1] == 8


def test_both_tilings_compile_ahead_of_time():
    from llmc.plugins import triton_aot

    reqs = [requests.int4_matmul_request(2048, 2048, 128, z, "bf16", wide=w) for z in (False, True)
            for w in (False, True)]
    for req, k in zip(reqs, triton_aot.compile_requests(reqs, 90), strict=True):
        entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
        assert entry.count(".param") == 10, (req["key"], entry)  # the visible parameters only
        assert k["target"].startswith("sm_90") and k["shared_mem"] <= 100 * 1024
