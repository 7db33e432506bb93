"""Hybrid models on llmc's CUDA engine, with no GPU: the recurrent-state kernels and the engines.

The Triton kernels of plugins/recurrent (CausalConv1d, the gated delta rule, Mamba2's SSD scan) run under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on fresh random inputs and a step that packs fresh
prefills, a continued chunk, decodes and a padding row, against the numpy reference (normative) and the torch
reference (the CUDA engine's fallback); chunked = token by token; and they compile ahead of time for every target SM.
Then ``--gpu h100`` engines of tiny random Qwen3.5, Nemotron-H and LFM2 models (the fixtures of tests/test_hybrid_*.py,
built once per module) run with ``device="cpu"`` and must give transformers' greedy tokens in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from llmc.plugins.recurrent import reference, requests  # noqa: E402
from llmc.plugins.recurrent import torch_reference as tref  # noqa: E402

# a step: a fresh prefill, a continued chunk, two decodes, one padding row (slot -1, as a padded CUDA graph feeds)
ROWS = [7, 4, 1, 1, 1]
SLOTS = [3, 0, 4, 1, -1]
CTX = [7, 13, 30, 2, 1]
NUM_SLOTS = 5


def _meta():
    return (np.asarray(SLOTS, np.int64), np.asarray(CTX, np.int64), np.cumsum([0, *ROWS]).astype(np.int64))


def _numpy_oracle(fn, state, *args, **kw):
    """The numpy reference on the real sequences (it has no padding rows); the padding row's output is zero state's."""
    slots, ctx, qsl = _meta()
    real = slots >= 0
    out = fn(*args, slots[real], ctx[real], qsl[:int(real.sum()) + 1], state, **kw)
    return out


def _th(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _dtype_tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels, width, bias, silu", [(24, 4, True, True), (40, 3, False, False)])
def test_conv_kernel_matches_references(dtype, channels, width, bias, silu):
    from llmc.plugins.recurrent.triton_kernels import causal_conv1d_kernel

    rng = np.random.default_rng(channels + width)
    t = sum(ROWS)
    x = rng.standard_normal((t, channels), dtype=np.float32)
    w = rng.standard_normal((channels, width), dtype=np.float32)
    b = rng.standard_normal(channels, dtype=np.float32) if bias else None
    state0 = rng.standard_normal((NUM_SLOTS, channels, width - 1), dtype=np.float32)
    xt, wt = (a.to(dtype) for a in _th(x, w))
    bt = _th(b)[0].to(dtype) if bias else None
    slots, ctx, qsl = _th(*_meta())
    # torch reference == numpy reference (float32), padding row included
    want_state = state0.copy()
    want = _numpy_oracle(reference.causal_conv1d, want_state, x[:t - 1], w, b, activation=int(silu))
    ts = torch.from_numpy(state0.copy())
    got_ref = tref.causal_conv1d(*_th(x, w), _th(b)[0] if bias else None, slots, ctx, qsl, ts, int(silu))
    np.testing.assert_allclose(got_ref[:t - 1].numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ts.numpy(), want_state, rtol=1e-6, atol=1e-6)
    # the kernel == the torch reference, in the activation dtype
    cfg = requests.conv_request(channels, width, bias, silu, "fp32")["constexprs"]
    state = torch.from_numpy(state0.copy())
    out = torch.empty_like(xt)
    causal_conv1d_kernel[(len(ROWS), -(-channels // cfg["BLOCK_C"]))](
        xt, wt, bt if bias else wt, slots, ctx, qsl, state, out, **cfg)
    ts = torch.from_numpy(state0.copy())
    want_t = tref.causal_conv1d(xt, wt, bt, slots, ctx, qsl, ts, int(silu))
    torch.testing.assert_close(out.float(), want_t.float(), **_dtype_tol(dtype))
    torch.testing.assert_close(state, ts, **_dtype_tol(dtype))
    assert torch.equal(state[2], torch.from_numpy(state0[2]))  # no sequence's slot: untouched


HK, HV, DK, DV = 2, 4, 16, 12


def _delta_inputs(rng, t):
    q = rng.standard_normal((t, HK * DK), dtype=np.float32)
    k = rng.standard_normal((t, HK * DK), dtype=np.float32)
    v = rng.standard_normal((t, HV * DV), dtype=np.float32)
    g = -rng.uniform(0.01, 1.0, (t, HV)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, HV)).astype(np.float32)
    return q, k, v, g, beta


def _delta_kernel(inputs, slots, ctx, qsl, state, dtype):
    from llmc.plugins.recurrent.triton_kernels import gated_delta_kernel

    cfg = requests.delta_request(HK, HV, DK, DV, True, "fp32")["constexprs"]
    q, k, v, g, beta = (a.to(dtype) for a in _th(*inputs))
    out = torch.empty_like(v)
    gated_delta_kernel[(len(slots), HV, -(-DV // cfg["BLOCK_V"]))](q, k, v, g, beta, slots, ctx, qsl, state, out,
                                                                  **cfg)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_kernel_matches_references(dtype):
    rng = np.random.default_rng(11)
    t = sum(ROWS)
    inputs = _delta_inputs(rng, t)
    state0 = rng.standard_normal((NUM_SLOTS, HV, DK, DV), dtype=np.float32) * 0.3
    slots, ctx, qsl = _th(*_meta())
    want_state = state0.copy()
    want = _numpy_oracle(reference.gated_delta_rule, want_state, *(a[:t - 1] for a in inputs), num_k_heads=HK,
                         num_v_heads=HV)
    ts = torch.from_numpy(state0.copy())
    got_ref = tref.gated_delta_rule(*_th(*inputs), slots, ctx, qsl, ts, HK, HV)
    np.testing.assert_allclose(got_ref[:t - 1].numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ts.numpy(), want_state, rtol=1e-4, atol=1e-5)
    state = torch.from_numpy(state0.copy())
    out = _delta_kernel(inputs, slots, ctx, qsl, state, dtype)
    ts = torch.from_numpy(state0.copy())
    want_t = tref.gated_delta_rule(*(a.to(dtype) for a in _th(*inputs)), slots, ctx, qsl, ts, HK, HV)
    torch.testing.assert_close(out.float(), want_t.float(), **_dtype_tol(dtype))
    torch.testing.assert_close(state, ts, **_dtype_tol(dtype))
    assert torch.equal(state[2], torch.from_numpy(state0[2]))


def test_gated_delta_kernel_chunked_equals_token_by_token_and_transformers():
    """One 70-token sequence in one step = a 30-token chunk, a 25-token chunk, then decodes; = transformers' chunked
    torch form (its prefill), state included."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    rng = np.random.default_rng(12)
    inputs = _delta_inputs(rng, 70)
    state = torch.from_numpy(rng.standard_normal((2, HV, DK, DV), dtype=np.float32))  # garbage: fresh ignores it

    def run(a, b_):
        meta = _th(np.asarray([1]), np.asarray([b_]), np.asarray([0, b_ - a]))
        return _delta_kernel([x[a:b_] for x in inputs], *meta, state, torch.float32)

    whole = run(0, 70)
    after = state[1].clone()
    parts = torch.cat([run(0, 30), run(30, 55)] + [run(i, i + 1) for i in range(55, 70)])
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[1], after, rtol=1e-4, atol=1e-5)
    q, k, v, g, beta = (torch.from_numpy(a)[None] for a in inputs)
    hf, final = m.torch_chunk_gated_delta_rule(q.reshape(1, 70, HK, DK), k.reshape(1, 70, HK, DK),
                                               v.reshape(1, 70, HV, DV), g=g, beta=beta, initial_state=None,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(whole, hf[0].reshape(70, HV * DV), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(state[1], final[0], rtol=2e-4, atol=2e-4)


H, G, P, N = 4, 2, 6, 16


def _ssd_inputs(rng, t):
    x = rng.standard_normal((t, H * P), dtype=np.float32)
    b = rng.standard_normal((t, G * N), dtype=np.float32)
    c = rng.standard_normal((t, G * N), dtype=np.float32)
    dt = rng.standard_normal((t, H), dtype=np.float32)
    return x, b, c, dt


def _ssd_params(rng):
    a_log = np.log(rng.uniform(1, 8, H)).astype(np.float32)
    return a_log, rng.standard_normal(H, dtype=np.float32), rng.standard_normal(H, dtype=np.float32)


def _ssd_kernel(inputs, params, slots, ctx, qsl, state, dtype, dt_limit=(0.0, float("inf"))):
    from llmc.plugins.recurrent.triton_kernels import ssd_scan_kernel

    cfg = requests.ssd_request(H, G, P, N, *dt_limit, "fp32")["constexprs"]
    x, b, c, dt, a_log, d, dt_bias = (a.to(dtype) for a in _th(*inputs, *params))
    out = torch.empty_like(x)
    ssd_scan_kernel[(len(slots), H, -(-P // cfg["BLOCK_P"]))](x, b, c, dt, a_log, d, dt_bias, slots, ctx, qsl, state,
                                                              out, **cfg)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_kernel_matches_references(dtype):
    rng = np.random.default_rng(13)
    t = sum(ROWS)
    inputs, params = _ssd_inputs(rng, t), _ssd_params(rng)
    state0 = rng.standard_normal((NUM_SLOTS, H, P, N), dtype=np.float32)
    slots, ctx, qsl = _th(*_meta())
    want_state = state0.copy()
    want = _numpy_oracle(reference.ssd_scan, want_state, *(a[:t - 1] for a in inputs), *params, num_heads=H,
                         n_groups=G, dt_min=0.0, dt_max=4.0)
    ts = torch.from_numpy(state0.copy())
    got_ref = tref.ssd_scan(*_th(*inputs, *params), slots, ctx, qsl, ts, H, G, 0.0, 4.0)
    np.testing.assert_allclose(got_ref[:t - 1].numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ts.numpy(), want_state, rtol=1e-4, atol=1e-5)
    state = torch.from_numpy(state0.copy())
    out = _ssd_kernel(inputs, params, slots, ctx, qsl, state, dtype, (0.0, 4.0))
    ts = torch.from_numpy(state0.copy())
    want_t = tref.ssd_scan(*(a.to(dtype) for a in _th(*inputs, *params)), slots, ctx, qsl, ts, H, G, 0.0, 4.0)
    torch.testing.assert_close(out.float(), want_t.float(), **_dtype_tol(dtype))
    torch.testing.assert_close(state, ts, **_dtype_tol(dtype))
    assert torch.equal(state[2], torch.from_numpy(state0[2]))


def test_ssd_kernel_chunked_equals_token_by_token_and_transformers():
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    rng = np.random.default_rng(14)
    inputs, params = _ssd_inputs(rng, 37), _ssd_params(rng)
    state = torch.from_numpy(rng.standard_normal((2, H, P, N), dtype=np.float32))

    def run(a, b_):
        meta = _th(np.asarray([1]), np.asarray([b_]), np.asarray([0, b_ - a]))
        return _ssd_kernel([x[a:b_] for x in inputs], params, *meta, state, torch.float32)

    whole = run(0, 37)
    after = state[1].clone()
    parts = torch.cat([run(0, 20)] + [run(i, i + 1) for i in range(20, 37)])
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[1], after, rtol=1e-4, atol=1e-5)
    x, b, c, dt = (torch.from_numpy(a) for a in inputs)
    a_log, d, dt_bias = (torch.from_numpy(a) for a in params)
    hf, final = m.mamba2_chunk_scan(x.reshape(1, 37, H, P), dt[None], -torch.exp(a_log), b.reshape(1, 37, G, N),
                                    c.reshape(1, 37, G, N), chunk_size=16, D=d, dt_bias=dt_bias, dt_softplus=True,
                                    dt_limit=(0.0, float("inf")), return_final_states=True)
    torch.testing.assert_close(whole, hf.reshape(37, H * P), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[1], final[0], rtol=1e-4, atol=1e-4)


def test_recurrent_kernels_compile_ahead_of_time_for_every_target_sm():
    from llmc.compiler.targets import TARGETS
    from llmc.plugins import triton_aot

    reqs = [requests.conv_request(8192, 4, True, True, "bf16"), requests.delta_request(16, 32, 128, 128, True, "bf16"),
            requests.ssd_request(128, 8, 64, 128, 0.0, float("inf"), "bf16")]
    sms = sorted({int(t.sm.replace(".", "")) for t in TARGETS.values() if t.sm})
    assert {80, 90, 100} <= set(sms)
    for sm in sms:
        built = triton_aot.compile_requests(reqs, sm)
        for req, k in zip(reqs, built, strict=True):
            entry = k["ptx"][k["ptx"].index(".entry"):].split(")")[0]
            visible = [n for n, t in req["signature"].items() if t != "constexpr"]
            assert entry.count(".param") == len(visible), (req["fn"], sm)  # hidden scratch params removed
            assert k["target"].startswith(f"sm_{sm}")
