"""The CUDA engine's LoRA kernels (plugins/lora) under the Triton interpreter, held to the torch reference on
fresh random inputs, and the reference to the graph's dense form; and their ahead-of-time compilation."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from llmc.plugins.lora.reference import lora_apply  # noqa: E402


def _case(t, k, n, slots, rank, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(k, slots * rank, generator=g) * 0.3).to(dtype)
    b = (torch.randn(slots * rank, n, generator=g) * 0.3).to(dtype)
    s = torch.randint(-1, slots + 1, (t,), generator=g, dtype=torch.int64)
    return x, y, a, b, s


def _dense(y, x, a, b, s, rank):
    """The graph's form (llmc.passes.lora): all slots' columns, those of other slots masked to zero."""
    slots = a.shape[1] // rank
    owner = torch.arange(1, slots + 1).repeat_interleave(rank)
    mask = (s[:, None] == owner[None, :]).float()
    return y.float() + ((x.float() @ a.float()) * mask) @ b.float()


@pytest.mark.parametrize("t, k, n, slots, rank", [(1, 64, 48, 1, 8), (7, 96, 130, 3, 4), (12, 200, 64, 4, 16)])
def test_reference_equals_the_graphs_dense_form(t, k, n, slots, rank):
    x, y, a, b, s = _case(t, k, n, slots, rank, torch.float32, seed=t + k)
    torch.testing.assert_close(lora_apply(y, x, a, b, s, rank), _dense(y, x, a, b, s, rank), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, k, n, slots, rank", [(1, 64, 48, 1, 8), (5, 96, 130, 3, 4), (9, 200, 64, 4, 16)])
def test_shrink_expand_kernels_equal_the_reference(dtype, t, k, n, slots, rank):
    from llmc.plugins.lora import requests
    from llmc.plugins.lora.triton_kernels import lora_expand_kernel, lora_shrink_kernel

    x, y, a, b, s = _case(t, k, n, slots, rank, dtype, seed=3 * t + n)
    shrink = requests.shrink_request(k, rank, slots, "bf16" if dtype == torch.bfloat16 else "fp32")["constexprs"]
    expand = requests.expand_request(n, rank, slots, "bf16" if dtype == torch.bfloat16 else "fp32")["constexprs"]
    u = torch.empty(t, rank, dtype=torch.float32)
    lora_shrink_kernel[(t,)](x, a, s, u, t, x.stride(0), **shrink)
    out = torch.empty_like(y)
    lora_expand_kernel[(t, -(-n // expand["BLOCK_N"]))](u, b, s, y, out, t, y.stride(0), **expand)
    want = lora_apply(y, x, a, b, s, rank)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)
    none = (s < 1)
    assert torch.equal(out[none], y[none])  # no adapter: the base output, untouched


def test_lora_kernels_compile_ahead_of_time_for_every_target_sm():
    from llmc.compiler.targets import TARGETS
    from llmc.plugins import triton_aot
    from llmc.plugins.lora import requests

    reqs = [requests.shrink_request(2048, 16, 4, "bf16"), requests.expand_request(2048, 16, 4, "bf16")]
    sms = sorted({int(t.sm.replace(".", "")) for t in TARGETS.values() if t.sm})
    assert {80, 90, 100} <= set(sms)
    for sm in sms:
        built = triton_aot.compile_requests(reqs, sm)
        for req, k in zip(reqs, built, strict=True):
            entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
            visible = [n for n, t in req["signature"].items() if t != "constexpr"]
            assert entry.count(".param") == len(visible), (req["fn"], sm)  # hidden scratch params removed
            assert k["target"].startswith(f"sm_{sm}")
