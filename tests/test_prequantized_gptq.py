"""GPTQ checkpoints (v1 and v2, groups in input order) carried exactly into llmc's INT4
(compiler/prequantized_int4.py).

Fixtures are packed by the test following GPTQ's documented layout (AutoGPTQ / GPTQModel ``pack``: ``qweight``
int32 ``[K/8, N]`` with input row ``8r + j`` in nibble ``j`` of row ``r``, ``qzeros`` int32 ``[K/G, N/8]`` packed
along N the same way, storing ``zero - 1`` in v1 and ``zero`` in v2, float16 ``scales`` ``[K/G, N]``, ``g_idx``
``[K]``) from random codes, zero points and scales for every decoder linear of a tiny Llama; the reference
dequantization is ``scales[g_idx] * (q - zeros[g_idx])`` in float32. The engine's weights must dequantize to it bit
for bit and its greedy tokens (float32 compute) equal transformers on the dequantized checkpoint. Refused, one line
each: act-order (desc_act, or a g_idx that is not k // group_size), a v1 zero point stored as 15, other bit widths.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from llmc.errors import UnsupportedError
from llmc.testing.greedy import PROMPTS, assert_greedy_matches_transformers
from llmc.testing.int4_checks import assert_int4_weights_dequantize_to

GROUP = 32


def pack_rows(codes: np.ndarray) -> np.ndarray:
    """int32 [R/8, C]: element 8r + j of each column in nibble j of row r."""
    words = np.zeros((codes.shape[0] // 8, codes.shape[1]), np.uint32)
    for j in range(8):
        words |= codes[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def pack_cols(codes: np.ndarray) -> np.ndarray:
    """int32 [R, C/8]: element 8c + j of each row in nibble j of column c."""
    return np.ascontiguousarray(pack_rows(np.ascontiguousarray(codes.T)).T)


def reference_dequantize(qweight, qzeros, scales, g_idx, v1: bool) -> np.ndarray:
    """GPTQ's dequantization, nn.Linear's [N, K]: scales[g_idx] * (q - zeros[g_idx]) (v1: stored zeros + 1)."""
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    q = ((qweight.view(np.uint32)[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    z = ((qzeros.view(np.uint32)[:, :, None] >> shifts[None, None, :]) & 15).reshape(qzeros.shape[0], -1)
    z = z.astype(np.int64) + (1 if v1 else 0)
    w = (q.astype(np.int64) - z[g_idx]).astype(np.float32) * scales.astype(np.float32)[g_idx]
    return np.ascontiguousarray(w.T)


def write_gptq_fixture(root: Path, *, v1: bool, qc_overrides: dict | None = None, g_idx=None) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import load_file, save_file

    from llmc.testing.checkpoints import write_tiny_llama

    plain = write_tiny_llama(root / "plain", intermediate_size=192)
    state = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(5)
    gptq, deq = {}, {}
    for name, w in state.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            gptq[name] = deq[name] = w
            continue
        n, k = w.shape
        codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
        zeros = rng.integers(1 if v1 else 0, 16, (k // GROUP, n)).astype(np.uint8)  # v1 cannot hold a zero of 0
        scales = rng.uniform(0.005, 0.03, (k // GROUP, n)).astype(np.float16)
        gi = np.arange(k, dtype=np.int32) // GROUP if g_idx is None else g_idx(k)
        stored = zeros - 1 if v1 else zeros
        qweight, qzeros = pack_rows(codes), pack_cols(stored)
        base = name[: -len(".weight")]
        gptq.update({f"{base}.qweight": torch.from_numpy(qweight), f"{base}.qzeros": torch.from_numpy(qzeros),
                     f"{base}.scales": torch.from_numpy(scales), f"{base}.g_idx": torch.from_numpy(gi)})
        deq[name] = torch.from_numpy(reference_dequantize(qweight, qzeros, scales, gi, v1))
    out = {}
    for kind, tensors in (("gptq", gptq), ("dequantized", deq)):
        d = root / kind
        shutil.copytree(plain, d)
        (d / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        out[kind] = d
    cfg = json.loads((out["gptq"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                  "sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2",
                                  **(qc_overrides or {})}
    (out["gptq"] / "config.json").write_text(json.dumps(cfg))
    return out["gptq"], out["dequantized"]


def test_unpack_is_gptq_layout():
    from llmc.compiler.prequantized_int4 import unpack_gptq

    rng = np.random.default_rng(0)
    k, n = 128, 48
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    zeros = rng.integers(1, 16, (k // 64, n)).astype(np.uint8)
    scales = rng.uniform(1e-3, 1e-1, (k // 64, n)).astype(np.float16)
    g_idx = np.arange(k) // 64
    for v1 in (True, False):
        stored = zeros - 1 if v1 else zeros
        qweight, qzeros = pack_rows(codes), pack_cols(stored)
        w = unpack_gptq(qweight, qzeros, scales, 64, v1)
        np.testing.assert_array_equal(w.q, codes.T)
        np.testing.assert_array_equal(w.zero_points, zeros.T)
        ref = reference_dequantize(qweight, qzeros, scales, g_idx, v1)
        assert np.array_equal(w.dequantize().view(np.uint32), ref.view(np.uint32))  # bit for bit


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_checkpoint_builds_exactly_and_matches_transformers(v1, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine

    ckpt, deq = write_gptq_fixture(tmp_path, v1=v1)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    exact = QuantRecipe(quant="int4", int4_kernel="mlas", int4_accuracy_level=1)  # float32 compute
    result = build(ckpt, tmp_path / "engine", BuildOptions(quant=exact))
    record = result.report["source_quantization"]
    assert (record["method"], record["version"], record["linears"]) == ("gptq", "v1" if v1 else "v2", 14)
    assert result.report["quantization"]["graph"]["calibrated"] == 8  # every linear site took the checkpoint's



    reference = load_file(deq / "model.safetensors")
    assert_int4_weights_dequantize_to(tmp_path / "engine", reference, linears=14)

    assert_greedy_matches_transformers(Engine.load(tmp_path / "engine"), deq, PROMPTS)


def _act_order(k: int) -> np.ndarray:
    return (np.random.default_rng(1).permutation(k) // GROUP).astype(np.int32)


@pytest.mark.parametrize("case,phrase", [
    (dict(qc_overrides={"desc_act": True}), "desc_act true"),
    (dict(g_idx=_act_order), "g_idx is not k // group_size"),
    (dict(qc_overrides={"bits": 8}), "4-bit GPTQ weights only"),
    (dict(qc_overrides={"group_size": -1}), "groups of 32, 64, 128"),
])
def test_refused(tmp_path, case, phrase):
    from llmc.compiler.checkpoint import load_checkpoint

    ckpt, _ = write_gptq_fixture(tmp_path, v1=False, **case)
    with pytest.raises(UnsupportedError, match=phrase) as info:
        load_checkpoint(ckpt)
    assert "\n" not in str(info.value) and "--quant int4-gptq" in str(info.value)


def test_v1_zero_point_that_does_not_fit_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from llmc.compiler.checkpoint import load_checkpoint

    ckpt, _ = write_gptq_fixture(tmp_path, v1=True)
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.qzeros"
    words = tensors[name].view(np.uint32).copy()
    words[0, 0] |= np.uint32(0xF)  # the first zero point stored as 15: v1's "zero - 1" of a zero point 0
    tensors[name] = words.view(np.int32)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(UnsupportedError, match="v1 zero point is stored as 15"):
        load_checkpoint(ckpt)


def test_gptq_v1_cuda_program_matches_transformers(tmp_path, monkeypatch):
    """The CUDA engine (h100, float32, built here with no GPU, run by torch on the CPU) keeps the weights too."""

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine

    ckpt, deq = write_gptq_fixture(tmp_path, v1=True)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(ckpt, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    assert result.report["quantization"]["graph"]["calibrated"] == 8
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cuda", device="cpu"), deq, PROMPTS)
