"""The CUDA engine's fused Triton kernels (RMSNorm + residual, rotary, SwiGLU) against the torch ops they replace.

Run under the Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), on fresh random
inputs, including the strided views of the packed projections that the program hands them; and compiled ahead of
time for sm_90 with the launch metadata the runtime reads.
"""

from __future__ import annotations

import pytest
import torch

from llmc.plugins.fused import triton_kernels as fk
from llmc.runtime.workers.cuda.ops import OPS

DTYPES = [torch.float32, torch.float16]


def _rand(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("n", [64, 200])
def test_rms_norm_kernel_equals_the_torch_op(dtype, skip, n):
    rows = 7
    x, res = _rand(1, rows, n, dtype=dtype), _rand(1, rows, n, dtype=dtype)
    w = (torch.rand(n) + 0.5).to(dtype)
    out, total = torch.empty_like(x), torch.empty_like(x)
    block = 1 << (n - 1).bit_length()
    fk.rms_norm_kernel[(rows,)](x, res, w, out, total, rows, N=n, BLOCK=block, EPS=1e-5, HAS_SKIP=skip,
                                ROUND_Y=dtype != torch.float32)
    if skip:
        want, want_total = OPS["SkipRMSNormalization"](x, res, w, epsilon=1e-5)
        torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    else:
        (want,) = OPS["RMSNormalization"](x, w, epsilon=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [(4, 16), (3, 64)])
def test_rotary_kernel_on_a_strided_view_equals_the_torch_op(dtype, heads, d):
    t = 9
    packed = _rand(1, t, heads * d * 3, dtype=dtype)
    x = packed[..., heads * d: 2 * heads * d]  # a column slice: rows 3*H*D apart, as after the QKV Split
    angles = torch.rand(1, t, d // 2) * 50
    cos, sin = torch.cos(angles), torch.sin(angles)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x.shape, dtype=dtype)
    fk.rotary_kernel[(t, heads)](x2, cos, sin, out, t, x2.stride(0), H=heads, D=d, HALF_PAD=max(16, d // 2))
    (want,) = OPS["RotaryEmbedding"](x, cos, sin, num_heads=heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [96, 1500])
def test_swiglu_kernel_on_split_views_equals_the_torch_op(dtype, n):
    rows = 5
    packed = _rand(1, rows, 2 * n, dtype=dtype)
    gate, up = torch.split(packed, [n, n], dim=-1)
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(gate.shape, dtype=dtype)
    block = min(1024, 1 << (n - 1).bit_length())
    fk.swiglu_kernel[(rows, -(-n // block))](g2, u2, out, rows, g2.stride(0), u2.stride(0), N=n, BLOCK=block)
    (want,) = OPS["SwiGLU"](gate, up)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


def test_fused_kernels_compile_ahead_of_time_for_every_sm():
    from llmc.plugins import triton_aot
    from llmc.plugins.fused import requests

    reqs = [requests.rms_norm_request(2048, 1e-5, True, "bf16", "bf16"), requests.rotary_request(32, 64, "bf16"),
            requests.swiglu_request(8192, "bf16")]
    for sm in (80, 90):
        for req, k in zip(reqs, triton_aot.compile_requests(reqs, sm), strict=True):
            entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
            visible = [n for n, t in req["signature"].items() if t != "constexpr"]
            assert entry.count(".param") == len(visible), (req["fn"], entry)  # hidden scratch params removed
            assert k["target"].startswith(f"sm_{sm}") and k["shared_mem"] <= 48 * 1024


# The W4A16 kernel (int4_matmul_kernel): tests/test_int4_triton_matmul.py, at every row count.
