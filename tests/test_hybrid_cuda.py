"""Hybrid models on llmc's CUDA engine, with no GPU: the recurrent-state kernels and the engines.

The Triton kernels of plugins/recurrent (CausalConv1d, the gated delta rule, Mamba2's SSD scan) run under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on fresh random inputs and a step that packs fresh
prefills, a continued chunk, decodes and a padding row, against the numpy reference (normative) and the torch
reference (the CUDA engine's fallback); chunked = token by token; and they compile ahead of time for every target SM.
Then ``--gpu h100`` engines of tiny random Qwen3.5, Nemotron-H and LFM2 models (the fixtures of tests/test_hybrid_*.py,
built once per module) run with ``device="cpu"`` and must give transformers' greedy tokens in float32.
"""

from __future__ import annotations

import json

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
    parts = torch.cat([run(0, 30), run(30, 65)] + [run(i, i + 1) for i in range(65, 70)])
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
    parts = torch.cat([run(0, 20), run(20, 33)] + [run(i, i + 1) for i in range(33, 37)])
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


# -- engines: --gpu h100 builds run by torch on the CPU -------------------------------------------------------------

NEW = 32
# The recurrent kernels each engine is built with (LFM2: none, to save the build's AOT compilation: its conv kernel is
# Qwen3.5's and Nemotron-H's; its recurrent ops run their torch references either way on device="cpu").
KERNEL_OPS = {"qwen3_5_text": {"causal_conv1d", "gated_delta_rule"}, "nemotron_h": {"causal_conv1d", "ssd_scan"},
              "lfm2": set()}


@pytest.fixture(scope="module", params=sorted(KERNEL_OPS))
def family(request, tmp_path_factory):
    """(model_type, engine dir, greedy references of PROMPTS[1:]): the tiny random checkpoints of
    tests/test_hybrid_*.py (llmc.testing.hybrids) built for an H100 in float32, the kernels compiled ahead of time."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.testing.hybrids import PROMPTS, greedy, write_hybrid

    root = tmp_path_factory.mktemp(request.param)
    hf = write_hybrid(request.param, root / "ckpt")
    build(root / "ckpt", root / "engine", BuildOptions(target="h100", dtype="float32",
                                                       aot_kernels=bool(KERNEL_OPS[request.param])))
    return request.param, root / "engine", greedy(hf, PROMPTS[1:], NEW)


def test_manifest_has_the_state_pool_and_the_recurrent_kernels(family):
    model_type, engine_dir, _ = family
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["engine"]["backend"] == "cuda" and manifest["state_cache"]["dtype"] == "float32"
    assert manifest["engine"]["inputs"][-1] == "state_slots"
    kernels = {k["key"]: k for k in manifest["engine"]["kernels"]}
    assert {k["op"] for k in kernels.values() if k["variant"] == "fused"} >= KERNEL_OPS[model_type]
    spec = json.loads((engine_dir / "program.json").read_text())
    state_nodes = [n for n in spec["nodes"] if n["op"] in ("CausalConv1d", "GatedDeltaRule", "SsdScan")]
    assert len(state_nodes) == len(manifest["state_cache"]["arrays"])
    for n in state_nodes:  # every recurrent node names its kernel (compiled unless AOT was off), its own state array
        assert n["attrs"]["kernel"].startswith({"CausalConv1d": "causal_conv1d", "GatedDeltaRule": "gated_delta_rule",
                                                "SsdScan": "ssd_scan"}[n["op"]])
        if KERNEL_OPS[model_type]:
            assert kernels[n["attrs"]["kernel"]]["file"].endswith(".sm90.cubin")
    assert sorted(n["attrs"]["state_idx"] for n in state_nodes) == list(range(len(state_nodes)))
    # Shape arithmetic was folded (compiler/backends/cuda_fold.py): host metadata (Shape's CPU tensors) reaches only
    # inputs the program reads as Python ints, never a device op (Qwen3.5's M-RoPE had Range -> ScatterND indices).
    from llmc.runtime.workers.cuda.program import HOST_INPUTS

    producer = {o: n["op"] for n in spec["nodes"] for o in n["outputs"]}
    assert not [n for n in spec["nodes"] if n["op"] == "Range"]
    assert not [(n["op"], j) for n in spec["nodes"] for j, name in enumerate(n["inputs"])
                if producer.get(name) == "Shape" and j not in HOST_INPUTS.get(n["op"], ())]


def test_engine_matches_transformers(family):
    """3 prompts (one past the 16-token prefill chunks) x 32 greedy tokens on device="cpu": batched with chunked
    prefill and through preemption (and, for Qwen3.5, each prompt alone); every slot given back, prefix caching off
    saying why."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS

    model_type, engine_dir, refs = family
    prompts = [list(p) for p in PROMPTS[1:]]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    engine = Engine.load(engine_dir, device="cpu", kv_cache_tokens=512, max_num_tokens=16)
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    stats = engine.stats()
    assert stats.state_slots_used == 0 and stats.state_slots_total == engine.config.max_num_seqs + 1
    assert "not snapshotted" in stats.prefix_caching_disabled_reason and stats.kv_blocks_cached == 0
    assert stats.state_bytes == sum(int(np.prod(a["shape"])) * 4 for a in engine.manifest["state_cache"]["arrays"]
                                    ) * stats.state_slots_total
    if model_type == "qwen3_5_text":  # batched = alone (once: the step code is the same for every family; chunked
        # prefill off is the CPU engine's tests' (tests/test_hybrid_*.py): the scheduler and state slots are shared)
        for prompt, ref in zip(prompts, refs, strict=True):
            assert engine.generate([prompt], params)[0].token_ids == ref
    engine = Engine.load(engine_dir, device="cpu", kv_cache_tokens=128, max_num_tokens=32)
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    assert engine.stats().num_preemptions > 0 and engine.stats().state_slots_used == 0


def test_kernel_launch_path_on_cpu_matches_transformers(family):
    """The session's recurrent-kernel launches (grids, argument order, the state pool by slot) run by the Triton
    interpreter from the manifest's entries: the GPU's launch code minus the driver; a chunked long prompt and a
    short one batched, then decodes."""
    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.core.state_cache import StatePool
    from llmc.runtime.workers.cuda.session import CudaSession
    from llmc.testing.hybrids import PROMPTS

    model_type, engine_dir, refs = family
    if not KERNEL_OPS[model_type]:
        pytest.skip(f"{model_type} is built without AOT kernels here (see KERNEL_OPS)")
    engine = Engine.load(engine_dir, device="cpu", kv_cache_tokens=256, max_num_tokens=32, max_num_seqs=2)
    session = CudaSession(engine_dir, engine.manifest, device="cpu", interpret_kernels=True)
    # the recurrent and fused kernels, and the attention layers' flash kernels (prefill, split-KV decode, reduce)
    assert {v for _, v in session.kernels} == {"fused", "flash-prefill", "flash-decode", "flash-reduce"}
    assert {k.info.key.split("-")[0] for k in session.kernels.values()} >= KERNEL_OPS[model_type]
    engine._pool = engine._stepper.pool = session.allocate_pool(engine.manifest["kv_cache"], engine._blocks.num_blocks)
    hybrid = engine.manifest["state_cache"]
    engine._state = engine._stepper.state = StatePool(session.allocate_state(hybrid, 3), list(hybrid["arrays"]),
                                                      [2, 1, 0])
    engine._session = engine._stepper.session = session  # generate() runs the stepper's session, pool and state
    # the interpreter walks every token of every program: a 37-token prompt in 32-token chunks beside a short one
    outs = engine.generate([list(PROMPTS[1]), list(PROMPTS[2])], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [refs[0][:3], refs[1][:3]]


def test_hybrid_gpu_build_with_tp_is_refused_before_any_work(tmp_path):
    from llmc.compiler.build import BuildOptions, build
    from llmc.errors import UnsupportedError
    from llmc.testing.hybrids import write_hybrid

    write_hybrid("lfm2", tmp_path / "ckpt")
    with pytest.raises(UnsupportedError, match="--tp 2"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions(target="h100", dtype="float32", tp=2))
    assert not (tmp_path / "e").exists()
