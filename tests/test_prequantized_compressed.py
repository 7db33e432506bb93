"""compressed-tensors ``pack-quantized`` INT4 checkpoints carried exactly into llmc's INT4
(compiler/prequantized_int4.py).

Fixtures are packed by the test following compressed-tensors' documented layout (``pack_to_int32``: signed 4-bit
values plus 8, eight per int32 along the packed dimension, element ``8c + j`` in nibble ``j``): ``weight_packed``
int32 ``[N, K/8]`` (packed along K), ``weight_scale`` ``[N, K/G]``, ``weight_zero_point`` int32 ``[N/8, K/G]`` (packed
along N, asymmetric only), ``weight_shape``; the reference dequantization is ``(q - z) * s`` on the signed values
(``z`` 0 when symmetric), in float32. The engine's weights must dequantize to it bit for bit and its greedy tokens
(float32 compute) equal transformers on the dequantized checkpoint. Other 4-bit int layouts are refused naming the
flag to use instead.
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


def pack_to_int32(signed: np.ndarray, axis: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32 for 4 bits: values + 8, eight per int32 along ``axis`` (padded)."""
    u = (signed.astype(np.int16) + 8).astype(np.uint32)
    if axis == 0:
        u = np.pad(u, ((0, -u.shape[0] % 8), (0, 0)))
        words = np.zeros((u.shape[0] // 8, u.shape[1]), np.uint32)
        for j in range(8):
            words |= u[j::8] << np.uint32(4 * j)
    else:
        words = np.zeros((u.shape[0], u.shape[1] // 8), np.uint32)
        for j in range(8):
            words |= u[:, j::8] << np.uint32(4 * j)
    return words.view(np.int32)


def write_fixture(root: Path, *, symmetric: bool, weights_overrides: dict | None = None,
                  fmt: str = "pack-quantized") -> tuple[Path, Path]:
    import torch
    from safetensors.torch import load_file, save_file

    from llmc.testing.checkpoints import write_tiny_llama

    plain = write_tiny_llama(root / "plain", intermediate_size=192)
    state = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(9)
    ct, deq = {}, {}
    for name, w in state.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            ct[name] = deq[name] = w
            continue
        n, k = w.shape
        q = rng.integers(-8, 8, (n, k)).astype(np.int8)
        z = np.zeros((n, k // GROUP), np.int8) if symmetric else rng.integers(-8, 8, (n, k // GROUP)).astype(np.int8)
        s = rng.uniform(0.005, 0.03, (n, k // GROUP)).astype(np.float16)
        base = name[: -len(".weight")]
        ct[f"{base}.weight_packed"] = torch.from_numpy(pack_to_int32(q, 1))
        ct[f"{base}.weight_scale"] = torch.from_numpy(s)
        ct[f"{base}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        if not symmetric:
            ct[f"{base}.weight_zero_point"] = torch.from_numpy(pack_to_int32(z, 0))
        ref = ((q.astype(np.int64) - np.repeat(z, GROUP, 1)).astype(np.float32)
               * np.repeat(s.astype(np.float32), GROUP, 1))
        deq[name] = torch.from_numpy(np.ascontiguousarray(ref))
    out = {}
    for kind, tensors in (("ct", ct), ("dequantized", deq)):
        d = root / kind
        shutil.copytree(plain, d)
        (d / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
        out[kind] = d
    cfg = json.loads((out["ct"] / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": GROUP,
               **(weights_overrides or {})}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt,
                                  "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
                                  "ignore": ["lm_head"]}
    (out["ct"] / "config.json").write_text(json.dumps(cfg))
    return out["ct"], out["dequantized"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_checkpoint_builds_exactly_and_matches_transformers(symmetric, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine

    ckpt, deq = write_fixture(tmp_path, symmetric=symmetric)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    exact = QuantRecipe(quant="int4", int4_kernel="mlas", int4_accuracy_level=1)  # float32 compute
    result = build(ckpt, tmp_path / "engine", BuildOptions(quant=exact))
    record = result.report["source_quantization"]
    assert (record["method"], record["linears"], record["zero_point"]) == ("compressed-tensors", 14, not symmetric)

    reference = load_file(deq / "model.safetensors")
    assert_int4_weights_dequantize_to(tmp_path / "engine", reference, linears=14)

    assert_greedy_matches_transformers(Engine.load(tmp_path / "engine"), deq, PROMPTS)


@pytest.mark.parametrize("case,phrase", [
    (dict(fmt="int-quantized"), "pack-quantized format only"),
    (dict(weights_overrides={"strategy": "channel", "group_size": None}), "in input order only"),
    (dict(weights_overrides={"actorder": "group"}), "in input order only"),
])
def test_refused(tmp_path, case, phrase):
    from llmc.compiler.checkpoint import load_checkpoint

    ckpt, _ = write_fixture(tmp_path, symmetric=True, **case)
    with pytest.raises(UnsupportedError, match=phrase) as info:
        load_checkpoint(ckpt)
    assert "\n" not in str(info.value) and "--quant int4" in str(info.value)


def test_asymmetric_cuda_program_matches_transformers(tmp_path, monkeypatch):
    """The CUDA engine (h100, float32, built here with no GPU, run by torch on the CPU) keeps the weights too."""

    from llmc.compiler.build import BuildOptions, build
    from llmc.runtime import Engine

    ckpt, deq = write_fixture(tmp_path, symmetric=False)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    result = build(ckpt, tmp_path / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    assert result.report["quantization"]["graph"]["calibrated"] == 8
    assert_greedy_matches_transformers(Engine.load(tmp_path / "cuda", device="cpu"), deq, PROMPTS)
