"""gpt-oss MXFP4 checkpoints (OpenAI's published layout) carried exactly: the experts stay E2M1 codes + E8M0 scales.

A gpt-oss checkpoint as OpenAI ships it (``quantization_config``: ``quant_method`` ``mxfp4``) stores each MoE layer's
two expert weights ``experts.gate_up_proj`` and ``experts.down_proj`` (transformers' parameters ``[E, K, N]``: input
dimension K first) as

- ``<proj>_blocks`` uint8 ``[E, N, K / 32, 16]``: FP4 E2M1 codes, two per byte, the low nibble first, 32 codes of one
  output row ``n`` along the input dimension per block;
- ``<proj>_scales`` uint8 ``[E, N, K / 32]``: one E8M0 exponent per block, bias 127;

and transformers' dequantization (``integrations/mxfp4.py``: ``convert_moe_packed_tensors``) is ``W[e, k, n] =
FP4[code(e, n, k)] * 2 ** (scale[e, n, k // 32] - 127)``, the 16 E2M1 values ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``
(sign in bit 3). Every other tensor (attention, router, embeddings, LM head, the experts' biases) is a plain float.

llmc keeps the blocks and scales as stored: the engine's MoE layers run ``llmc.Mxfp4MoEMatMul`` (plugins/mxfp4:
a lookup-table matmul over the codes in llmc's ONNX Runtime library; the graph rewrite is passes/mxfp4_experts.py),
so the experts occupy 4.25 bits per weight.
The float weight the rest of the build reads (tracing, the self-check, binding) is their exact dequantization in
float32 (a 3-bit significand times a power of two: exact while the exponent is within float32's range, checked).

Refused before any work, one line each: MXFP4 in a family other than gpt_oss, blocks or scales whose shapes or dtypes
do not fit each other and the layout, and (compiler/build.py) a ``--quant`` that would re-quantize the experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError

BLOCK = 32  # MXFP4: one E8M0 scale per 32 E2M1 codes
FAMILIES = ("gpt_oss",)
INSTEAD = "leave --quant out (the experts run as stored, the other weights in float32)"


@dataclass(frozen=True)
class Mxfp4Experts:
    """One expert weight's ``_blocks`` and ``_scales`` checkpoint tensors (TensorEntry each). ``read()`` is the
    float32 parameter transformers builds from them, ``[E, K, N]``."""

    blocks: object
    scales: object

    @property
    def experts(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def n(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def k(self) -> int:
        return BLOCK * int(self.blocks.shape[2])

    def codes(self) -> tuple[np.ndarray, np.ndarray]:
        """(blocks uint8 ``[E, N, K/32, 16]``, scales uint8 ``[E, N, K/32]``), as stored."""
        from llmc.compiler.safetensors_io import read_tensor

        return read_tensor(self.blocks), read_tensor(self.scales)

    def read(self) -> np.ndarray:
        return dequantize(*self.codes())

    def source(self):
        """The codes as the graph pass takes them (:class:`llmc.passes.mxfp4_experts.Mxfp4Source`)."""
        from llmc.compiler.safetensors_io import read_tensor
        from llmc.passes.mxfp4_experts import Mxfp4Source

        return Mxfp4Source(self.experts, self.n, self.k, lambda: read_tensor(self.blocks),
                           lambda: read_tensor(self.scales))


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, K, N]`` (transformers' parameter) of MXFP4 ``blocks`` ``[E, N, K/32, 16]`` and ``scales``
    ``[E, N, K/32]``: ``convert_moe_packed_tensors`` in float32, exact."""
    from llmc.plugins.mxfp4.reference import dequantize as rows_first

    return np.ascontiguousarray(rows_first(blocks, scales).transpose(0, 2, 1))


def plan(config: dict, qc: dict, tensors: dict, cfg_path: Path) -> tuple[dict, dict, dict[str, Mxfp4Experts]]:
    """Rewrite an MXFP4 checkpoint's tensor index: each ``<proj>_blocks``/``_scales`` pair becomes one float32
    ``<proj>`` entry (transformers' parameter) read as its exact dequantization. Returns ``(tensors, record,
    experts)``, ``experts`` by parameter name (what the graph pass hands the engine as codes)."""
    family = str(config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "")
    if family not in FAMILIES:
        raise UnsupportedError(f"{cfg_path}: quantization_config.quant_method 'mxfp4' with model_type {family!r}: llmc "
                               f"carries MXFP4 experts for {', '.join(FAMILIES)} only (OpenAI's gpt-oss layout); build "
                               "from the unquantized original with --quant int4 or --quant nvfp4")
    out = dict(tensors)
    experts: dict[str, Mxfp4Experts] = {}
    for name in sorted(n for n in tensors if n.endswith("_blocks")):
        base = name[: -len("_blocks")]
        blocks, scales = tensors[name], tensors.get(f"{base}_scales")
        if scales is None:
            raise LlmcError(f"{blocks.file}: MXFP4 tensor {name!r} has no {base}_scales beside it; the checkpoint is "
                            "incomplete (re-download it)")
        b, s = tuple(blocks.shape), tuple(scales.shape)
        fits = (blocks.dtype == "uint8" and scales.dtype == "uint8" and len(b) == 4 and b[3] == BLOCK // 2
                and s == b[:3] and b[0] > 0 and b[1] > 0 and b[2] > 0)
        if not fits:
            raise LlmcError(f"{blocks.file}: MXFP4 expert weight {base!r}: {name} {blocks.dtype} {list(b)} and "
                            f"{base}_scales {scales.dtype} {list(s)} do not fit OpenAI's layout (uint8 [E, N, K/32, "
                            "16] E2M1 pairs and uint8 [E, N, K/32] E8M0 scales); config.json's quantization_config "
                            "does not describe these weights")
        weight = Mxfp4Experts(blocks, scales)
        out[base] = replace(blocks, name=base, dtype="float32", shape=(weight.experts, weight.k, weight.n),
                            nbytes=4 * weight.experts * weight.k * weight.n, derived=weight)
        del out[name], out[f"{base}_scales"]
        experts[base] = weight
    stray = sorted(n for n in out if n.endswith("_scales") and n[: -len("_scales")] + "_blocks" not in tensors)
    if stray:
        base = stray[0][: -len("_scales")]
        raise LlmcError(f"{out[stray[0]].file}: MXFP4 tensor {stray[0]!r} has no {base}_blocks beside it; the "
                        "checkpoint is incomplete (re-download it)")
    if not experts:
        raise LlmcError(f"{cfg_path}: quantization_config says mxfp4, but no tensor ends in _blocks with its _scales; "
                        "config.json does not describe these weights")
    weights = sum(w.experts * w.n * w.k for w in experts.values())
    record = {"method": "mxfp4", "tensors": len(experts), "weights": weights, "block": BLOCK,
              "kept": "expert weights as E2M1 codes + E8M0 scales per 32 (4.25 bits per weight; never re-quantized)"}
    return out, record, experts


def carried(tensors: dict) -> dict[str, Mxfp4Experts]:
    """The MXFP4 expert weights a checkpoint's tensor index carries (by parameter name); empty for others."""
    return {name: e.derived for name, e in tensors.items() if isinstance(getattr(e, "derived", None), Mxfp4Experts)}
