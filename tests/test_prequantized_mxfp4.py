"""gpt-oss MXFP4 checkpoints carried as stored (compiler/prequantized_mxfp4.py, plugins/mxfp4).

The fixture is a tiny gpt-oss (transformers' own config class: sinks, a 16-token sliding window beside a full
layer, 4 experts, top-2) written by the test in OpenAI's published layout: each expert weight as ``<proj>_blocks``
uint8 ``[E, N, K/32, 16]`` (random E2M1 codes, two per byte, low nibble first) and ``<proj>_scales`` uint8
``[E, N, K/32]`` (random E8M0 exponents), every other tensor in bfloat16, ``quantization_config`` ``{"quant_method":
"mxfp4"}``. transformers' own MXFP4 dequantizer (``Mxfp4Config(dequantize=True)``, what it does on a machine without
its triton kernels) is the reference: llmc's reading of the codes must equal it bit for bit, the engine must keep
the experts as those codes (about 4.25 bits per weight, counted from the artifact's weight bytes) and its greedy
tokens (float32, 32 tokens x 3 prompts, one longer than the sliding window) must equal transformers running the
dequantized model, for the CPU engine and for the CUDA engine (--gpu h100, its program run by torch on the CPU).
The native op is held to the numpy reference on random inputs; each refusal is one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from llmc.errors import LlmcError, UnsupportedError
from llmc.plugins.mxfp4 import reference, single_op_model
from llmc.plugins.paged_attention import ort_native
from llmc.testing.ort_sessions import native_session

PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2])  # the second: past the 16-token window
ISAS = {0: "scalar", 1: "AVX2", 2: "AVX-512"}


def write_mxfp4_fixture(root: Path) -> Path:
    """A tiny gpt-oss in OpenAI's MXFP4 layout (random codes and exponents), bf16 elsewhere."""
    import torch
    from safetensors.torch import load_file, save_file

    from llmc.testing.tried_families import write_tried_family

    plain = write_tried_family("gpt_oss", root / "plain")
    state = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(5)
    tensors = {}
    for name, w in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = w.shape  # transformers' parameter: input dimension first
            tensors[f"{name}_blocks"] = torch.from_numpy(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8))
            # 2^-9 .. 2^-4: weights up to 6 x 2^-4, activations that stay in the clamp's range
            tensors[f"{name}_scales"] = torch.from_numpy(rng.integers(118, 124, (e, n, k // 32)).astype(np.uint8))
        else:
            tensors[name] = w.to(torch.bfloat16)
    out = root / "mxfp4"
    shutil.copytree(plain, out)
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# -- the native op against the reference ---------------------------------------------------------------------


@pytest.fixture
def mxfp4_isa():
    lib = ort_native.load()
    best = lib.llmc_mxfp4_get_isa()
    yield lambda isa: lib.llmc_mxfp4_set_isa(isa) == 0
    lib.llmc_mxfp4_set_isa(best)


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("e,n,k,rows", [(4, 96, 64, 1), (8, 40, 288, 13), (3, 70, 32, 64)])
def test_op_matches_reference(isa, e, n, k, rows, mxfp4_isa):
    """Random codes (every E2M1 value, both zeros), the whole E8M0 range that keeps products finite, random rows
    routed to random experts (some to none, some to many), N not a multiple of the kernel's tile."""
    if not mxfp4_isa(isa):
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    rng = np.random.default_rng([e, n, k, rows, isa])
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (e, n, k // 32)).astype(np.uint8)
    scales.flat[0], scales.flat[-1] = 0, 150  # 2^-127 (a float32 subnormal) and a large one
    x = rng.standard_normal((rows, 1, k)).astype(np.float32)
    ids = rng.integers(0, e, rows).astype(np.int64)
    want = reference.mxfp4_moe_matmul(x, ids, blocks, scales)
    for threads in (1, 2):
        got = native_session(single_op_model(blocks, scales), threads=threads).run(None, {"X": x, "ids": ids})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("activation,x_share,combine,bias", [(1, 1, 1, True), (1, 4, 1, True), (0, 1, 4, True),
                                                             (0, 2, 2, False), (1, 1, 1, False)])
def test_op_epilogue_matches_reference(isa, activation, x_share, combine, bias, mxfp4_isa):
    """The exact op's fused epilogue (csrc/moe_epilogue.h, shared with the Q8 op): expert bias, gpt-oss's clamped
    SwiGLU over interleaved gate/up columns (values on both sides of the clamp limits), the top-k repeat of X's
    rows and the routing-weighted sum of a token's k results, against the reference; and against the unfused op
    with the same steps done in numpy."""
    if not mxfp4_isa(isa):
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    e, n, k, tokens, topk = 6, 96, 128, 5, 4
    rng = np.random.default_rng([isa, activation, x_share, combine, bias])
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(124, 128, (e, n, k // 32)).astype(np.uint8)
    b = (rng.standard_normal((e, n)) * 4).astype(np.float32) if bias else None
    rows = tokens * topk
    x = rng.standard_normal((rows // x_share, 1, k)).astype(np.float32)
    ids = rng.integers(0, e, rows).astype(np.int64)
    w = rng.random(rows).astype(np.float32)
    epi = {"bias": b, "activation": activation, "x_share": x_share, "combine": combine}
    sums = reference.mxfp4_moe_matmul(np.repeat(x, x_share, axis=0), ids, blocks, scales, bias=b)
    assert (sums > 7).any() and (sums < -7).any()
    feeds = {"X": x, "ids": ids, **({"weights": w} if combine > 1 else {})}
    got = native_session(single_op_model(blocks, scales, **epi), threads=2).run(None, feeds)[0]
    want = reference.mxfp4_moe_matmul(x, ids, blocks, scales, **epi, weights=w)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    plain = native_session(single_op_model(blocks, scales), threads=2)
    y = plain.run(None, {"X": np.repeat(x, x_share, axis=0), "ids": ids})[0][:, 0]
    y = y + b[ids] if bias else y
    y = reference.swiglu_oai(y[:, 0::2], y[:, 1::2]) if activation else y
    y = (y.reshape(-1, combine, y.shape[-1]) * w.reshape(-1, combine, 1)).sum(1) if combine > 1 else y
    np.testing.assert_allclose(got.reshape(y.shape), y, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("isa", list(ISAS))
def test_op_matches_reference_for_every_rows_per_expert(isa, mxfp4_isa):
    """Expert e gets e + 1 rows (1..9, shuffled): every count of rows the kernel takes in one pass (1, 2, 3, 4) and
    the remainders after passes of four, each against the reference."""
    if not mxfp4_isa(isa):
        pytest.skip(f"this CPU has no {ISAS[isa]}")
    rng = np.random.default_rng([9, isa])
    e, n, k = 9, 48, 320
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 135, (e, n, k // 32)).astype(np.uint8)
    ids = rng.permutation(np.repeat(np.arange(e), np.arange(1, e + 1))).astype(np.int64)
    x = rng.standard_normal((len(ids), 1, k)).astype(np.float32)
    want = reference.mxfp4_moe_matmul(x, ids, blocks, scales)
    got = native_session(single_op_model(blocks, scales), threads=2).run(None, {"X": x, "ids": ids})[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_op_matches_reference(dtype):
    """The CUDA engine's Mxfp4MoEMatMul (runtime/workers/cuda/ops.py, run here on the CPU): float32 to rounding;
    bfloat16 (its weights decode exactly, the activations and sums are bfloat16) to bfloat16's precision."""
    import torch

    from llmc.runtime.workers.cuda.ops import OPS

    rng = np.random.default_rng(11)
    e, n, k, rows = 5, 48, 96, 9
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(115, 130, (e, n, k // 32)).astype(np.uint8)
    x = rng.standard_normal((rows, 1, k)).astype(np.float32)
    ids = rng.integers(0, e, rows).astype(np.int64)
    want = reference.mxfp4_moe_matmul(x, ids, blocks, scales)
    t = getattr(torch, dtype)
    (got,) = OPS["Mxfp4MoEMatMul"](torch.from_numpy(x).to(t), torch.from_numpy(ids), torch.from_numpy(blocks),
                                   torch.from_numpy(scales))
    assert got.dtype == t and tuple(got.shape) == want.shape
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got.float().numpy(), want, rtol=tol, atol=tol * np.abs(want).max())


def test_op_refuses_bad_inputs():
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    blocks = np.zeros((2, 8, 2, 16), np.uint8)
    session = native_session(single_op_model(blocks, np.full((2, 8, 2), 127, np.uint8)))
    x = np.ones((3, 1, 64), np.float32)
    with pytest.raises(RuntimeException, match=r"expert_ids\[1\] = 2 is outside"):
        session.run(None, {"X": x, "ids": np.array([0, 2, 1], np.int64)})
    with pytest.raises(RuntimeException, match="one expert per row"):
        session.run(None, {"X": x, "ids": np.array([0, 1], np.int64)})


# -- the checkpoint -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return write_mxfp4_fixture(tmp_path_factory.mktemp("mxfp4"))


@pytest.fixture(scope="module")
def transformers_model(fixture_dir):
    """transformers' own load of the MXFP4 checkpoint, dequantized (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(fixture_dir, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_codes_read_as_transformers_dequantizes_them(fixture_dir, transformers_model):
    """llmc's reading of every expert weight equals transformers' MXFP4 dequantization bit for bit (and its
    convert_moe_packed_tensors on the raw tensors), so the engine's codes are the checkpoint's."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from llmc.compiler import prequantized_mxfp4
    from llmc.compiler.checkpoint import load_checkpoint

    ckpt = load_checkpoint(fixture_dir)
    carried = prequantized_mxfp4.carried(ckpt.tensors)
    assert sorted(carried) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                     for p in ("gate_up_proj", "down_proj"))
    assert ckpt.source_quantization["method"] == "mxfp4"
    params = dict(transformers_model.named_parameters())
    for name, weight in carried.items():
        ours = weight.read()
        theirs = params[name].detach().numpy()
        assert ours.shape == theirs.shape and ours.dtype == np.float32
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name
        blocks, scales = weight.codes()
        raw = convert_moe_packed_tensors(torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()),
                                         dtype=torch.float32).numpy()
        assert np.array_equal(ours.view(np.uint32), raw.view(np.uint32)), name


@pytest.fixture(scope="module")
def engine_dir(fixture_dir, tmp_path_factory):
    import os

    from llmc.compiler.build import build

    out = tmp_path_factory.mktemp("mxfp4_engine") / "engine"
    old = os.environ.get("LLMC_CACHE_DIR")
    os.environ["LLMC_CACHE_DIR"] = str(out.parent / "cache")
    try:
        result = build(fixture_dir, out)
    finally:
        if old is None:
            os.environ.pop("LLMC_CACHE_DIR", None)
        else:
            os.environ["LLMC_CACHE_DIR"] = old
    return out, result


@pytest.fixture(scope="module")
def reference_tokens(transformers_model) -> list[list[int]]:
    """transformers' greedy tokens on the dequantized checkpoint: 32 per prompt, float32."""
    import torch

    out = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = transformers_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                              do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def test_engine_keeps_the_codes_and_matches_transformers(engine_dir, reference_tokens):
    """The experts reach the engine as the checkpoint's blocks and scales (4.25 bits per weight, counted from the
    weights file's bytes), report.json says so, and the greedy tokens equal transformers'."""
    import onnx
    from onnx import external_data_helper

    from llmc.runtime import Engine, SamplingParams

    out, result = engine_dir
    record = result.report["source_quantization"]
    assert record["method"] == "mxfp4" and "never re-quantized" in record["kept"]
    assert result.report["mxfp4"]["matmuls"] == 4
    # attention (qkv, o) of both layers and the LM head, stored bfloat16, stay bfloat16 (the routers are Gemms)
    assert result.report["backend_fusions"]["bf16-weights"] == 5
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "Mxfp4MoEMatMul"]
    assert len(nodes) == 4
    # the expert glue in the ops' epilogue (bias x4, SwiGLU x2, top-k repeat x2, weighted sum x2), and gpt-oss's
    # rotary and sinks in RotaryPagedAttention (both layers)
    assert result.report["backend_fusions"]["mxfp4-epilogue"] == 10
    assert result.report["backend_fusions"]["rotary-attention"] == 2
    assert not {"Sigmoid", "Clip", "Slice", "Expand", "ReduceSum"} & {n.op_type for n in model.graph.node}
    sizes = {}
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        sizes[t.name] = int(info["length"]) if external_data_helper.uses_external_data(t) else len(t.raw_data)
    expert_bytes = sum(sizes[i] for n in nodes for i in n.input[2:4])
    expert_weights = sum(int(np.prod(t.dims)) * 2 for n in nodes
                         for t in model.graph.initializer if t.name == n.input[2])
    # 2 layers x 4 experts x (gate_up + down)
    assert expert_weights == record["weights"] == 2 * 4 * (64 * 256 + 128 * 64)
    assert 8 * expert_bytes / expert_weights == pytest.approx(4.25)
    assert not any("experts" in t.name and t.data_type == TensorProto.FLOAT and len(t.dims) == 3
                   for t in model.graph.initializer)  # no float copy of any expert weight

    engine = Engine.load(out)
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, got, want in zip(PROMPTS, outs, reference_tokens, strict=True):
        assert got.token_ids == want, (prompt, got.token_ids, want)
    from click.testing import CliRunner

    from llmc.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    assert f"checkpoint  quantized as mxfp4, {record['tensors']} tensors: expert weights as E2M1 codes" in shown.output


def test_cuda_engine_keeps_the_codes_and_matches_transformers(fixture_dir, reference_tokens, tmp_path, monkeypatch):
    """--gpu h100 (float32, built with no GPU, its program run by torch on the CPU): the experts stay uint8 blocks
    and scales in weights.safetensors (the Mxfp4MoEMatMul torch op decodes each routed row's codes, W4A16), no float
    copy of them, and the greedy tokens equal transformers'."""
    from safetensors import safe_open

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine, SamplingParams

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(fixture_dir, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    assert result.report["mxfp4"]["matmuls"] == 4
    with safe_open(tmp_path / "cuda" / "weights.safetensors", "np") as f:
        kinds = {name: (f.get_slice(name).get_dtype(), len(f.get_slice(name).get_shape())) for name in f.keys()}
    assert sum(1 for n, (dt, _) in kinds.items() if "experts" in n and dt == "U8") == 8  # 4 blocks + 4 scales
    assert not any("experts" in n and dt != "U8" and rank >= 3 for n, (dt, rank) in kinds.items())
    engine = Engine.load(tmp_path / "cuda", device="cpu")
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, got, want in zip(PROMPTS, outs, reference_tokens, strict=True):
        assert got.token_ids == want, (prompt, got.token_ids, want)


# -- refusals ------------------------------------------------------------------------------------------------


def test_other_families_are_refused(tmp_path, tiny_llama):
    from llmc.compiler.checkpoint import load_checkpoint

    ckpt = tmp_path / "llama"
    shutil.copytree(tiny_llama, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="model_type 'llama'.*gpt_oss only") as info:
        load_checkpoint(ckpt)
    assert "\n" not in str(info.value) and info.value.exit_code == 3


def test_malformed_blocks_and_scales_are_refused(fixture_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    from llmc.compiler.checkpoint import load_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(fixture_dir, bad)
    name = "model.layers.0.mlp.experts.down_proj"
    for edit, phrase in ((lambda t: t.update({f"{name}_scales": t[f"{name}_scales"][:, :, :2]}), "do not fit"),
                         (lambda t: t.update({f"{name}_blocks": t[f"{name}_blocks"][..., :8]}), "do not fit"),
                         (lambda t: t.pop(f"{name}_scales"), "no model.layers.0.mlp.experts.down_proj_scales"),
                         (lambda t: t.pop(f"{name}_blocks"), "no model.layers.0.mlp.experts.down_proj_blocks")):
        tensors = load_file(fixture_dir / "model.safetensors")
        edit(tensors)
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, bad / "model.safetensors")
        with pytest.raises(LlmcError, match=phrase) as info:
            load_checkpoint(bad)
        assert "\n" not in str(info.value) and info.value.exit_code == 2 and "model.safetensors" in str(info.value)


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_requantizing_is_refused(fixture_dir, tmp_path, quant):
    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe

    with pytest.raises(UnsupportedError, match=f"--quant {quant} would re-quantize them") as info:
        build(fixture_dir, tmp_path / "e", BuildOptions(quant=QuantRecipe(quant=quant)))
    assert "\n" not in str(info.value) and info.value.exit_code == 3 and not (tmp_path / "e").exists()


# -- the opt-in 8-bit activations (--mxfp4-activations int8: llmc.Mxfp4MoEMatMulQ8) ---------------------------


@pytest.fixture
def q8_vnni():
    lib = ort_native.load()
    best = 1 if lib.llmc_mxfp4_q8_set_vnni(1) == 0 else 0
    yield lambda on: lib.llmc_mxfp4_q8_set_vnni(on) == 0
    lib.llmc_mxfp4_q8_set_vnni(best)


@pytest.mark.parametrize("vnni", [0, 1])
@pytest.mark.parametrize("e,n,k,rows", [(4, 96, 64, 1), (8, 40, 288, 13), (3, 70, 32, 64), (9, 48, 320, 45)])
def test_q8_op_matches_its_reference(vnni, e, n, k, rows, q8_vnni):
    """The kernel against the reference of the same quantized rows (integer sums exact, float sums to rounding),
    N not a multiple of the 16-output group, 1 to 9+ rows per expert (passes of 8 rows); and against the exact op:
    8-bit rows cost at most ~1% of the output's scale. The repacking keeps every code and exponent."""
    if not q8_vnni(vnni):
        pytest.skip("this CPU has no AVX-512 VNNI")
    from llmc.plugins.mxfp4 import single_op_model_q8

    rng = np.random.default_rng([e, n, k, rows, vnni])
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (e, n, k // 32)).astype(np.uint8)
    scales.flat[0], scales.flat[-1] = 0, 1  # 2^-127 and 2^-126: the subnormal half-scales
    x = rng.standard_normal((rows, 1, k)).astype(np.float32)
    x[0, 0, :32] = 0  # a block of zeros (scale 0)
    ids = rng.integers(0, e, rows).astype(np.int64)
    codes, sc = reference.repack_q8(blocks, scales)
    assert codes.shape == (e, -(-n // 16), k // 32, 4, 64) and 8 * codes.nbytes / (e * 16 * -(-n // 16) * k) == 4
    want = reference.mxfp4_moe_matmul_q8(x, ids, blocks, scales)
    exact = reference.mxfp4_moe_matmul(x, ids, blocks, scales)
    got = native_session(single_op_model_q8(codes, sc, n), threads=2).run(None, {"X": x, "ids": ids})[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    assert np.abs(got - exact).max() <= 1.5e-2 * np.abs(exact).max()
    # the repacked codes decode to the same weights: unpack them through the layout the docstring states
    t, g = codes.shape[1], codes.shape[2]
    lo, hi = codes & 15, codes >> 4
    pairs = np.stack([lo.reshape(e, t, g, 4, 16, 4), hi.reshape(e, t, g, 4, 16, 4)], axis=4)  # [e,t,g,r,half,nn,jj]
    unpacked = pairs.transpose(0, 1, 5, 2, 3, 4, 6).reshape(e, t * 16, g, 32)[:, :n]
    originals = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(e, n, g, 32)
    np.testing.assert_array_equal(unpacked, originals)
    np.testing.assert_array_equal(sc.transpose(0, 1, 3, 2).reshape(e, t * 16, g)[:, :n], scales)


@pytest.mark.parametrize("vnni", [0, 1])
@pytest.mark.parametrize("e,n,k,rows,activation", [(4, 96, 64, 3, 1), (8, 40, 288, 13, 1), (3, 70, 32, 20, 0),
                                                    (9, 5760 // 64, 320, 45, 1)])
def test_q8_epilogue_matches_its_reference(vnni, e, n, k, rows, activation, q8_vnni):
    """The fused epilogue: each row's expert bias added and, with activation 1, gpt-oss's clamped SwiGLU over the
    interleaved gate/up columns (N/2 outputs), against the reference applied to the reference's sums; gate and up
    values on both sides of the clamp limits (scales chosen so that sums reach past +-limit)."""
    if not q8_vnni(vnni):
        pytest.skip("this CPU has no AVX-512 VNNI")
    from llmc.plugins.mxfp4 import single_op_model_q8

    rng = np.random.default_rng([e, n, k, rows, activation, vnni, 7])
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(124, 128, (e, n, k // 32)).astype(np.uint8)
    bias = rng.standard_normal((e, n)).astype(np.float32) * 4
    x = rng.standard_normal((rows, 1, k)).astype(np.float32)
    ids = rng.integers(0, e, rows).astype(np.int64)
    codes, sc = reference.repack_q8(blocks, scales)
    sums = reference.mxfp4_moe_matmul_q8(x, ids, blocks, scales, bias=bias)
    assert (sums > 7).any() and (sums < -7).any() and (np.abs(sums) < 7).any()
    want = reference.mxfp4_moe_matmul_q8(x, ids, blocks, scales, bias=bias, activation=activation, alpha=1.702,
                                         limit=7.0)
    model = single_op_model_q8(codes, sc, n, bias=bias, activation=activation, alpha=1.702, limit=7.0)
    got = native_session(model, threads=2).run(None, {"X": x, "ids": ids})[0]
    assert got.shape == (rows, 1, n // 2 if activation else n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    if activation:  # the same as the graph's nodes applied to the unfused op's output
        plain = native_session(single_op_model_q8(codes, sc, n), threads=2).run(None, {"X": x, "ids": ids})[0]
        plain = plain[:, 0] + bias[ids]
        np.testing.assert_allclose(got[:, 0], reference.swiglu_oai(plain[:, 0::2], plain[:, 1::2]), rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("vnni", [0, 1])
@pytest.mark.parametrize("x_share,combine,bias", [(4, 1, False), (1, 4, True), (4, 4, True), (2, 2, False)])
def test_q8_top_k_repeat_and_combine_match_the_reference(vnni, x_share, combine, bias, q8_vnni):
    """The fused top-k routing around the op: ``x_share`` k (each X row serves k routed rows, quantized once) and
    ``combine`` k (the k routed results of a token summed with their routing weights), against the reference, and
    against the unfused op with the repeat and the weighted sum done in numpy."""
    if not q8_vnni(vnni):
        pytest.skip("this CPU has no AVX-512 VNNI")
    from llmc.plugins.mxfp4 import single_op_model_q8

    e, n, k, tokens, topk = 6, 40, 96, 5, 4
    rng = np.random.default_rng([x_share, combine, bias, vnni])
    blocks = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 122, (e, n, k // 32)).astype(np.uint8)
    b = rng.standard_normal((e, n)).astype(np.float32) if bias else None
    rows = tokens * topk
    x = rng.standard_normal((rows // x_share, 1, k)).astype(np.float32)
    ids = rng.integers(0, e, rows).astype(np.int64)
    w = rng.random(rows).astype(np.float32)
    codes, sc = reference.repack_q8(blocks, scales)
    feeds = {"X": x, "ids": ids, **({"weights": w} if combine > 1 else {})}
    model = single_op_model_q8(codes, sc, n, bias=b, x_share=x_share, combine=combine)
    got = native_session(model, threads=2).run(None, feeds)[0]
    want = reference.mxfp4_moe_matmul_q8(x, ids, blocks, scales, bias=b, x_share=x_share, combine=combine,
                                         weights=w)
    assert got.shape == want.shape == (rows // combine, 1, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    plain = native_session(single_op_model_q8(codes, sc, n, bias=b), threads=2)
    unfused = plain.run(None, {"X": np.repeat(x, x_share, axis=0), "ids": ids})[0][:, 0]
    unfused = (unfused.reshape(-1, combine, n) * w.reshape(-1, combine, 1)).sum(1) if combine > 1 else unfused
    np.testing.assert_allclose(got[:, 0], unfused, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_q8_routing_attributes_are_checked():
    """Bad fused-routing inputs fail in one line naming the input, not with a crash."""
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    from llmc.plugins.mxfp4 import single_op_model_q8

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (2, 16, 1, 16), dtype=np.uint8)
    codes, sc = reference.repack_q8(blocks, np.full((2, 16, 1), 120, np.uint8))
    x = rng.standard_normal((2, 1, 32)).astype(np.float32)
    sess = native_session(single_op_model_q8(codes, sc, 16, x_share=2, combine=2), threads=1)
    with pytest.raises(RuntimeException, match="times x_share"):
        sess.run(None, {"X": x, "ids": np.zeros(3, np.int64), "weights": np.ones(3, np.float32)})
    with pytest.raises(RuntimeException, match="weights holding one float per routed row"):
        sess.run(None, {"X": x, "ids": np.zeros(4, np.int64), "weights": np.ones(3, np.float32)})


def test_q8_engine_is_close_to_the_exact_one(fixture_dir, engine_dir, tmp_path, monkeypatch):
    """--mxfp4-activations int8: the experts run as Mxfp4MoEMatMulQ8 on the same codes (4.25 bits per weight),
    report.json says the activations are 8-bit, and the next-token distributions stay close to the exact engine's
    (mean KL over every position of three prompts < 0.01 nats, the same argmax at >= 90% of positions)."""
    import onnx

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(fixture_dir, tmp_path / "q8", BuildOptions(mxfp4_activations="int8"))
    assert result.report["mxfp4"]["op"] == "llmc.Mxfp4MoEMatMulQ8" and "int8" in result.report["mxfp4"]["activations"]
    model = onnx.load(str(tmp_path / "q8" / "model.onnx"), load_external_data=False)
    q8_nodes = [n for n in model.graph.node if n.op_type == "Mxfp4MoEMatMulQ8"]
    assert len(q8_nodes) == 4
    assert not any(n.op_type == "Mxfp4MoEMatMul" for n in model.graph.node)
    # the backend folded into the ops each expert bias (4), each gate_up's clamped SwiGLU and top-k repeat of its
    # rows (2 + 2) and each down's weighted top-k sum (2)
    assert result.report["backend_fusions"]["mxfp4-epilogue"] == 10

    def attr(node, name):
        return next((a.i for a in node.attribute if a.name == name), 0)

    topk = json.loads((fixture_dir / "config.json").read_text())["num_experts_per_tok"]
    assert sorted((attr(n, "activation"), attr(n, "x_share"), attr(n, "combine"), len(n.input)) for n in q8_nodes) \
        == [(0, 0, topk, 6)] * 2 + [(1, topk, 0, 5)] * 2
    assert not {"Sigmoid", "Clip", "Slice", "Expand", "ReduceSum"} & {n.op_type for n in model.graph.node}
    exact, q8 = Engine.load(engine_dir[0]), Engine.load(tmp_path / "q8")
    kls, same = [], []
    for prompt in PROMPTS:
        a, b = exact.score(list(prompt)), q8.score(list(prompt))
        la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
        lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
        kls.extend((np.exp(la) * (la - lb)).sum(-1))
        same.extend(a.argmax(-1) == b.argmax(-1))
    assert 0 < np.mean(kls) < 0.01 and np.mean(same) >= 0.9, (np.mean(kls), np.mean(same))


def test_q8_is_refused_where_it_does_not_apply(fixture_dir, tiny_llama, tmp_path):
    from llmc.compiler.build import BuildOptions, build

    with pytest.raises(LlmcError, match="--mxfp4-activations int8 applies to checkpoints whose MoE experts are "
                                        "MXFP4") as info:
        build(tiny_llama, tmp_path / "a", BuildOptions(mxfp4_activations="int8"))
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    with pytest.raises(UnsupportedError, match="--mxfp4-activations int8 is a CPU-engine kernel") as info:
        build(fixture_dir, tmp_path / "b", BuildOptions(target="h100", mxfp4_activations="int8"))
    assert "\n" not in str(info.value) and info.value.exit_code == 3 and not (tmp_path / "b").exists()
