"""AutoAWQ GEMM checkpoints carried exactly into llmc's INT4 (compiler/prequantized_int4.py).

The fixture is packed by the test following AutoAWQ's documented GEMM layout (``qweight`` int32 ``[K, N/8]`` with
the pack order [0, 2, 4, 6, 1, 3, 5, 7], ``qzeros`` int32 ``[K/G, N/8]`` packed the same way, float16 ``scales``
``[K/G, N]``) from random codes, zero points and scales for every linear of a tiny Llama; its reference
dequantization is AutoAWQ's ``dequantize_gemm`` formula ``(q - z) * s``, evaluated in float32. The engine's
``Int4MatMul`` weights must dequantize to it bit for bit (codes and scales as stored, never re-quantized), and the
engine's greedy tokens must equal transformers running the dequantized checkpoint (float32). Each refusal (other
AWQ layouts, other bit widths, no zero points, unsupported group sizes, tensors that do not fit, a --quant that
would re-quantize, GPU targets) is one line naming the reason and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llmc.errors import LlmcError, UnsupportedError
from llmc.testing.greedy import PROMPTS, assert_greedy_matches_transformers

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order (awq/utils/packing_utils.py)
GROUP = 32


def pack_awq(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packing of a [R, C] code matrix into int32 [R, C/8] (its documented loop, vectorised)."""
    words = np.zeros((intweight.shape[0], intweight.shape[1] // 8), np.uint32)
    for col in range(words.shape[1]):
        for i in range(8):
            words[:, col] |= intweight[:, col * 8 + ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def reference_dequantize(qweight, qzeros, scales, group_size):
    """AutoAWQ's dequantize_gemm: unpack (shifts 0, 4, ..., 28), undo the pack order, (q - z) * s, in float32;
    returns nn.Linear's [N, K]."""
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]
    shifts = np.arange(0, 32, 4, dtype=np.uint32)

    def unpack(x):
        v = (x.view(np.uint32)[:, :, None] >> shifts[None, None, :]) & np.uint32(15)
        v = v.reshape(x.shape[0], -1)
        idx = np.arange(v.shape[1]).reshape(-1, 8)[:, reverse].reshape(-1)
        return v[:, idx].astype(np.int64)

    iw, iz = unpack(qweight), unpack(qzeros)
    s = np.repeat(scales.astype(np.float32), group_size, axis=0)
    z = np.repeat(iz, group_size, axis=0)
    return ((iw - z).astype(np.float32) * s).T


def write_awq_fixture(root: Path, *, group_size: int = GROUP, qc_overrides: dict | None = None) -> tuple[Path, Path]:
    """A tiny Llama as an AutoAWQ GEMM checkpoint (every decoder linear) and the same model dequantized (float32).
    Returns (awq checkpoint, dequantized checkpoint)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from llmc.testing.checkpoints import write_tiny_llama

    plain = write_tiny_llama(root / "plain", intermediate_size=192)  # K a whole number of groups
    state = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(3)
    awq, deq = {}, {}
    for name, w in state.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            awq[name] = deq[name] = w
            continue
        n, k = w.shape
        codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
        zeros = rng.integers(0, 16, (k // group_size, n)).astype(np.uint8)
        scales = (rng.uniform(0.005, 0.03, (k // group_size, n))).astype(np.float16)
        base = name[: -len(".weight")]
        qweight, qzeros = pack_awq(codes), pack_awq(zeros)
        awq[f"{base}.qweight"] = torch.from_numpy(qweight)
        awq[f"{base}.qzeros"] = torch.from_numpy(qzeros)
        awq[f"{base}.scales"] = torch.from_numpy(scales)
        deq[name] = torch.from_numpy(np.ascontiguousarray(reference_dequantize(qweight, qzeros, scales, group_size)))
    out = {}
    for kind, tensors in (("awq", awq), ("dequantized", deq)):
        d = root / kind
        shutil.copytree(plain, d)
        (d / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        out[kind] = d
    cfg = json.loads((out["awq"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size,
                                  "zero_point": True, **(qc_overrides or {})}
    (out["awq"] / "config.json").write_text(json.dumps(cfg))
    return out["awq"], out["dequantized"]


def test_unpack_is_autoawq_layout():
    from llmc.compiler.prequantized_int4 import unpack

    rng = np.random.default_rng(0)
    k, n = 128, 48
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    zeros = rng.integers(0, 16, (k // 64, n)).astype(np.uint8)
    scales = rng.uniform(1e-3, 1e-1, (k // 64, n)).astype(np.float16)
    qweight, qzeros = pack_awq(codes), pack_awq(zeros)
    w = unpack(qweight, qzeros, scales, 64)
    np.testing.assert_array_equal(w.q, codes.T)  # the codes as stored, output rows first
    np.testing.assert_array_equal(w.zero_points, zeros.T)
    np.testing.assert_array_equal(w.scales, scales.astype(np.float32).T)
    ref = reference_dequantize(qweight, qzeros, scales, 64)
    assert np.array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))  # bit for bit
    # in float16, AutoAWQ's kernels round that exact value once: the same float16 values
    np.testing.assert_array_equal(w.dequantize().astype(np.float16), ref.astype(np.float16))


def _int4_matmul_weights(model_path: Path) -> dict[str, np.ndarray]:
    """Each Int4MatMul's weight [N, K], dequantized from its tiles (plugins/int4_matmul/pack.py's layout)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    out = {}
    for node in m.graph.node:
        if node.op_type != "Int4MatMul":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        w, scales, mins = (inits[i] for i in node.input[1:4])
        tiles, octets, _ = w.shape
        lo, hi = w & 15, w >> 4  # [tiles, octets, 64]: byte 4c + i = q[16t + c, 8o + i] | q[16t + c, 8o + 4 + i] << 4
        q = np.stack([lo.reshape(tiles, octets, 16, 4), hi.reshape(tiles, octets, 16, 4)], 3)  # [t, o, c, 2, 4]
        q = q.transpose(0, 2, 1, 3, 4).reshape(tiles * 16, octets * 8).astype(np.float32)
        s = scales.transpose(0, 2, 1).reshape(tiles * 16, -1)
        mn = mins.transpose(0, 2, 1).reshape(tiles * 16, -1)
        g = attrs["group_size"]
        deq = q * np.repeat(s, g, axis=1) - np.repeat(mn, g, axis=1)
        out[node.input[1].split(".int4_tiles")[0]] = deq[: attrs["N"], : attrs["K"]]
    return out


def _matmulnbits_weights(model_path: Path) -> dict[str, np.ndarray]:
    """Each MatMulNBits' weight [N, K], dequantized from its packing (quant/int4.py's layout)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_path))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    out = {}
    for node in m.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        b, scales, zp = (inits[i] for i in node.input[1:4])
        n, ng, half = b.shape
        q = np.stack([b & 15, b >> 4], -1).reshape(n, ng, 2 * half).astype(np.float32)
        z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :ng].astype(np.float32)
        out[node.input[1].removesuffix(".int4")] = ((q - z[:, :, None]) * scales[:, :, None]).reshape(n, -1)[
            :, : attrs["K"]]
    return out


def _assert_weights_exact(got: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    from llmc.passes.quantize import members_of

    seen = 0
    for name, w in got.items():
        members = members_of(name)
        want = np.concatenate([reference[m] for m in members], axis=0)
        w, want = w.view(np.uint32), want.view(np.uint32)
        if "gate_proj" in name and "up_proj" in name:  # the fused SwiGLU interleaves gate/up rows: compare row sets
            w, want = w[np.lexsort(w.T[::-1])], want[np.lexsort(want.T[::-1])]
        assert np.array_equal(w, want), name
        seen += len(members)
    assert seen == 14  # 2 layers x 7 linears, every one carried


def test_awq_checkpoint_builds_exactly_and_matches_transformers(tmp_path, monkeypatch):
    """The default build (llmc's Int4MatMul, int8 activations) holds the checkpoint's weights bit for bit; the
    float32-compute build (MatMulNBits at accuracy level 1) holds them too and gives transformers' greedy tokens on
    the dequantized checkpoint (int8 activations would perturb random weights' flat logits)."""
    from safetensors.numpy import load_file

    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine

    awq, deq = write_awq_fixture(tmp_path)
    reference = load_file(deq / "model.safetensors")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(awq, tmp_path / "engine")
    record = result.report["source_quantization"]
    assert record["method"] == "awq" and record["linears"] == 14 and "never re-quantized" in record["kept"]
    recipe = result.manifest["recipe"]["quant"]
    assert (recipe["quant"], recipe["group_size"], recipe["symmetric"]) == ("int4", GROUP, False)
    assert (recipe["embeddings"], recipe["lm_head"]) == ("none", "none")
    _assert_weights_exact(_int4_matmul_weights(tmp_path / "engine" / "model.onnx"), reference)

    exact = QuantRecipe(quant="int4", int4_kernel="mlas", int4_accuracy_level=1)
    build(awq, tmp_path / "fp32", BuildOptions(quant=exact))
    _assert_weights_exact(_matmulnbits_weights(tmp_path / "fp32" / "model.onnx"), reference)
    assert_greedy_matches_transformers(Engine.load(tmp_path / "fp32"), deq, PROMPTS)


def test_awq_checkpoint_cuda_program_matches_transformers(tmp_path, monkeypatch):
    """The CUDA engine (h100, float32, built with no GPU and run by torch on the CPU) keeps the checkpoint's codes,
    zero points and scales (block-wise DequantizeLinear + MatMul, lowered to its Int4Linear) and gives transformers'
    greedy tokens on the dequantized checkpoint."""

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine

    awq, deq = write_awq_fixture(tmp_path)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(awq, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    assert result.report["source_quantization"]["method"] == "awq"
    quantization = result.report["quantization"]
    assert quantization["graph"]["calibrated"] == 8 and "calibration" not in quantization  # the checkpoint's weights
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cuda", device="cpu"), deq, PROMPTS)


@pytest.mark.parametrize("overrides,phrase", [
    ({"version": "gemv"}, "not the gemv layout"),
    ({"bits": 8}, "4-bit AWQ weights only"),
    ({"zero_point": False}, "with zero points only"),
    ({"group_size": 16}, "groups of 32, 64, 128"),
])
def test_refused_layouts(tmp_path, overrides, phrase):
    from llmc.compiler.checkpoint import load_checkpoint

    awq, _ = write_awq_fixture(tmp_path, qc_overrides=overrides)
    with pytest.raises(UnsupportedError, match=phrase) as info:
        load_checkpoint(awq)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)


def test_refused_requests_and_bad_tensors(tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    from llmc.compiler.build import BuildOptions, build
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.quant.recipe import QuantRecipe

    awq, _ = write_awq_fixture(tmp_path)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedError, match="--quant fp8 would dequantize and re-quantize it"):
        build(awq, tmp_path / "e1", BuildOptions(quant=QuantRecipe(quant="fp8")))
    with pytest.raises(UnsupportedError, match="--symmetric would drop its zero points"):
        build(awq, tmp_path / "e2", BuildOptions(quant=QuantRecipe(quant="int4", symmetric=True)))
    with pytest.raises(UnsupportedError, match="--dtype bfloat16 would round its float16 scales"):
        build(awq, tmp_path / "e3", BuildOptions(target="h100"))
    tensors = load_file(awq / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.scales"] = tensors["model.layers.0.mlp.up_proj.scales"][:, :8]
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(LlmcError, match="do not fit AutoAWQ's GEMM layout"):
        load_checkpoint(awq)
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(LlmcError, match="has model.layers.0.mlp.up_proj.qweight but no"):
        load_checkpoint(awq)
