"""Checkpoints that arrive quantized (``quantization_config`` in config.json): converted exactly or refused.

What people download in 2026 is often already quantized. llmc never reads such weights as if they were
plain floats:

- **FP8** (``quant_method`` ``fp8``: transformers' fine-grained FP8, DeepSeek-V3 / Qwen3-FP8 style, E4M3
  weights with ``weight_scale_inv`` per 128 x 128 block; or ``compressed-tensors`` float-quantized: E4M3
  weights with ``weight_scale`` per tensor, per output channel or per block) is dequantized exactly: every
  E4M3 code times its float32 scale, in float32 (a product of a 4-bit and a 24-bit significand, rounded
  once to float32's 24 bits: relative error at most 2**-24). The build then proceeds from those values, and
  ``--quant fp8`` re-quantizes them with llmc's own per-channel scales (reported by the accuracy check).
  Static activation scales and KV-cache scales in the checkpoint are dropped (recorded in the report).
- **AutoAWQ GEMM**, **GPTQ** (v1, v2; groups in input order) and compressed-tensors **pack-quantized** INT4 are
  carried exactly: codes, zero points and scales as stored become llmc's INT4 weights
  (compiler/prequantized_int4.py), never dequantized and re-quantized.
- gpt-oss **MXFP4** experts are carried as stored (compiler/prequantized_mxfp4.py).
- **Every other method** (other AWQ layouts, act-order GPTQ, bitsandbytes, HQQ, NVFP4 compressed-tensors,
  …) is refused before any work, naming the method and what to do instead: llmc quantizes
  from the original unquantized checkpoint itself (``--quant int4-awq`` / ``int4-gptq`` / ``int4`` / ``nvfp4``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from llmc.errors import LlmcError, UnsupportedError

FP8_STORED = "float8_e4m3fn"
_SCALE_SUFFIXES = ("_scale_inv", "_scale")  # weight_scale_inv (fp8), weight_scale (compressed-tensors)
_DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".weight_zero_point", ".input_zero_point")
_INSTEAD = {
    "awq": "--quant int4-awq", "gptq": "--quant int4-gptq", "gptqmodel": "--quant int4-gptq",
    "bitsandbytes": "--quant int4", "hqq": "--quant int4",
}


@dataclass(frozen=True)
class Fp8Scale:
    """How an E4M3 weight ``[N, K]`` is scaled: ``scale`` (a TensorEntry) per tensor, per output row, or per
    ``block`` = (rows, cols) tile."""

    scale: object  # TensorEntry of the scales (float32 / bfloat16 / float16)
    block: tuple[int, int] | None  # None: per tensor or per row, by the scale's shape


def method(config: dict) -> str | None:
    """The checkpoint's quantization method, lower-case, or None for a plain float checkpoint."""
    for section in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        qc = section.get("quantization_config")
        if isinstance(qc, dict):
            return str(qc.get("quant_method") or "unknown").lower()
    return None


def _qc(config: dict) -> dict:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    return qc if isinstance(qc, dict) else {}


def _compressed_fp8_block(qc: dict, cfg_path: Path) -> tuple[int, int] | None:
    """The compressed-tensors weight block size, or None; refuses formats other than 8-bit float."""
    fmt = str(qc.get("format") or "")
    groups = qc.get("config_groups") or {}
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise UnsupportedError(
                f"{cfg_path}: quantization_config is compressed-tensors with {weights.get('num_bits')}-bit "
                f"{weights.get('type')} weights (group {name!r}, format {fmt!r}); llmc converts only FP8 "
                "checkpoints exactly. Build from the unquantized original and let llmc quantize it "
                "(--quant int4-awq, int4-gptq, int4 or nvfp4)")
        block = weights.get("block_structure")
        if isinstance(block, list) and len(block) == 2:
            return int(block[0]), int(block[1])
    return None


def plan(config: dict, tensors: dict, cfg_path: Path) -> tuple[dict, dict | None]:
    """Check a pre-quantized checkpoint and rewrite its tensor index for exact dequantization.

    Returns ``(tensors, record)``: the index with every E4M3 weight's entry turned into a float32 entry that
    :func:`llmc.compiler.safetensors_io.read_tensor` dequantizes, its scales (and dropped companions) removed;
    ``record`` describes the conversion for report.json (None for a plain checkpoint). Raises
    :class:`UnsupportedError` (exit 3) for methods llmc does not convert.
    """
    kind = method(config)
    fp8_tensors = [n for n, e in tensors.items() if e.dtype == FP8_STORED]
    if kind is None:
        if fp8_tensors:
            raise LlmcError(f"{cfg_path}: tensor {fp8_tensors[0]!r} is stored in FP8 but config.json has no "
                            "quantization_config saying how it is scaled; add the checkpoint's original config.json")
        return tensors, None
    qc = _qc(config)
    if kind in ("awq", "gptq"):  # INT4 carried exactly (compiler/prequantized_int4.py); refused there if it cannot be
        from llmc.compiler import prequantized_int4

        planner = prequantized_int4.plan if kind == "awq" else prequantized_int4.plan_gptq
        tensors, record, _ = planner(qc, tensors, cfg_path)
        return tensors, record
    if kind == "mxfp4":  # gpt-oss experts carried as E2M1 codes + E8M0 scales (compiler/prequantized_mxfp4.py)
        from llmc.compiler import prequantized_mxfp4

        tensors, record, _ = prequantized_mxfp4.plan(config, qc, tensors, cfg_path)
        return tensors, record
    if kind == "compressed-tensors":
        from llmc.compiler import prequantized_int4

        if prequantized_int4.compressed_int4_group(qc, cfg_path) is not None:  # pack-quantized INT4, carried exactly
            tensors, record, _ = prequantized_int4.plan_compressed(qc, tensors, cfg_path)
            return tensors, record
    if kind not in ("fp8", "compressed-tensors"):
        instead = _INSTEAD.get(kind, "--quant int4-awq, int4-gptq, int4 or nvfp4")
        raise UnsupportedError(
            f"{cfg_path}: the checkpoint is already quantized (quantization_config.quant_method {kind!r}); llmc "
            f"does not read {kind} weights, and dequantizing them on a guess could build a wrong engine. Build "
            f"from the unquantized original checkpoint with {instead}")
    block = None
    if kind == "fp8":
        wbs = qc.get("weight_block_size")
        block = (int(wbs[0]), int(wbs[1])) if isinstance(wbs, list) and len(wbs) == 2 else None
    else:
        block = _compressed_fp8_block(qc, cfg_path)
    out = dict(tensors)
    converted = 0
    for name in fp8_tensors:
        entry = tensors[name]
        scale_name = next((name + s for s in _SCALE_SUFFIXES if name + s in tensors), None)
        if scale_name is None or len(entry.shape) != 2:
            raise LlmcError(f"{entry.file}: FP8 tensor {name!r} ({list(entry.shape)}) has no {name}_scale_inv or "
                            f"{name}_scale beside it; the checkpoint is incomplete (re-download it)")
        scale = tensors[scale_name]
        n, k = entry.shape
        s_shape = tuple(d for d in scale.shape)
        if s_shape in ((), (1,), (1, 1)) or s_shape in ((n,), (n, 1)):
            how = Fp8Scale(scale, None)
        elif block is not None and s_shape == (-(-n // block[0]), -(-k // block[1])):
            how = Fp8Scale(scale, block)
        else:
            raise LlmcError(f"{scale.file}: scale {scale_name!r} has shape {list(s_shape)}, which fits neither per "
                            f"tensor, per row ({n}) nor blocks {list(block) if block else '(no weight_block_size)'} "
                            f"of the {list(entry.shape)} weight {name!r}; config.json's quantization_config "
                            "does not describe these weights")
        out[name] = replace(entry, dtype="float32", fp8_scale=how)
        del out[scale_name]
        converted += 1
    dropped = sorted(n for n in out if n.endswith(_DROPPED_SUFFIXES))
    for n in dropped:
        del out[n]
    record = {"method": kind, "weights": "float8_e4m3fn", "block": list(block) if block else None,
              "tensors_dequantized": converted, "dequantized_to": "float32 (exact up to one float32 rounding)",
              "dropped": len(dropped)}
    return out, record
