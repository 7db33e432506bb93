"""Pre-quantized INT4 checkpoints carried exactly: AutoAWQ GEMM.

An AutoAWQ GEMM checkpoint (``quantization_config``: ``quant_method`` ``awq``, ``version`` ``gemm``, ``bits`` 4,
``zero_point`` true) stores each quantized linear ``m`` (``nn.Linear`` weight ``[N, K]``) as

- ``m.qweight`` int32 ``[K, N / 8]``: eight 4-bit codes per word, the code of output column ``8 c + ORDER[i]`` in
  bits ``4 i .. 4 i + 3`` of word ``c`` (AutoAWQ's pack order ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``);
- ``m.qzeros`` int32 ``[K / G, N / 8]``: the zero points, packed the same way;
- ``m.scales`` float16 ``[K / G, N]``;

and AutoAWQ's reference dequantization (``dequantize_gemm``) is ``W^T[k, n] = (q[k, n] - z[k // G, n]) *
s[k // G, n]``. llmc's INT4 weights (:class:`llmc.quant.int4.Int4Weights`: ``(q - zp) * scale`` per ``[N, G]``
group, float32 scales) hold exactly these codes, zero points and scales (float16 widens to float32 exactly), so
the engine's weights dequantize to the reference's values bit for bit when it is evaluated in float32 (a code
difference of at most 15 times a float16 scale needs 15 significant bits: the float32 product is exact; evaluated
in float16, AutoAWQ's own kernels round that exact value once). Nothing is dequantized and re-quantized: the
build's INT4 stage takes these weights as they are (:func:`int4_weights`), and the float weights the rest of the
build reads (tracing, the self-check, the unquantized reference of the accuracy report) are their exact
dequantization.

Refused, naming the reason and the flag to use instead: other AWQ versions (``gemv``, ``gemv_fast``, ``marlin``,
``exllama``: other layouts), bits other than 4, no zero points, group sizes llmc's INT4 does not run, and a layer
whose three tensors do not fit each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError
from llmc.quant.int4 import GROUP_SIZES, Int4Weights, SpilledInt4

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i of a word holds column 8c + ORDER[i]
_PARTS = ("qweight", "qzeros", "scales")
INSTEAD = "--quant int4-awq on the unquantized original checkpoint"


@dataclass(frozen=True)
class AwqLinear:
    """One AWQ GEMM linear's three checkpoint tensors (TensorEntry each) and its group size."""

    qweight: object
    qzeros: object
    scales: object
    group_size: int

    @property
    def n(self) -> int:
        return int(self.scales.shape[1])

    @property
    def k(self) -> int:
        return int(self.qweight.shape[0])

    def read(self) -> np.ndarray:
        """float32 ``[N, K]``: the exact dequantization (the build's float view of this weight)."""
        return self.load().dequantize()

    def load(self) -> Int4Weights:
        """:class:`llmc.quant.int4.Int4Weights` ``[N, K]`` with the checkpoint's codes, zero points and scales."""
        from llmc.compiler.checkpoint import read_tensor

        return unpack(read_tensor(self.qweight), read_tensor(self.qzeros), read_tensor(self.scales), self.group_size)


def unpack_columns(packed: np.ndarray) -> np.ndarray:
    """uint8 ``[R, 8 C]`` codes of int32 words ``[R, C]`` packed in AutoAWQ's order."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    out = np.empty((words.shape[0], words.shape[1], 8), np.uint8)
    for i, col in enumerate(ORDER):
        out[:, :, col] = (words >> np.uint32(4 * i)) & np.uint32(0xF)
    return out.reshape(words.shape[0], -1)


def unpack(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int) -> Int4Weights:
    """AutoAWQ GEMM tensors -> :class:`llmc.quant.int4.Int4Weights` ``[N, K]`` (codes, zero points and scales as
    stored, transposed to llmc's output-channel rows)."""
    codes = unpack_columns(qweight)  # [K, N]
    zeros = unpack_columns(qzeros)  # [K / G, N]
    return Int4Weights(q=np.ascontiguousarray(codes.T), scales=np.ascontiguousarray(scales.astype(np.float32).T),
                       zero_points=np.ascontiguousarray(zeros.T), group_size=group_size, k=int(codes.shape[0]))


def _config(qc: dict, cfg_path: Path) -> int:
    """The group size of an AWQ GEMM ``quantization_config``; refuses what llmc cannot carry exactly."""
    version = str(qc.get("version") or "gemm").lower()
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    where = f"{cfg_path}: quantization_config (AWQ"
    if version != "gemm":
        raise UnsupportedError(f"{where} version {version!r}): llmc carries AutoAWQ GEMM checkpoints exactly, not "
                               f"the {version} layout; use the GEMM export of this model, or build from the "
                               f"unquantized original with {INSTEAD.split(' on ')[0]}")
    if bits != 4:
        raise UnsupportedError(f"{where} bits {bits!r}): llmc carries 4-bit AWQ weights only; build from the "
                               f"unquantized original with {INSTEAD.split(' on ')[0]}")
    if qc.get("zero_point") is False:
        raise UnsupportedError(f"{where} zero_point false): llmc carries AWQ GEMM weights with zero points only; "
                               f"build from the unquantized original with {INSTEAD.split(' on ')[0]}")
    if group not in GROUP_SIZES:
        raise UnsupportedError(f"{where} group_size {group!r}): llmc's INT4 kernels run groups of "
                               f"{', '.join(map(str, GROUP_SIZES))}; build from the unquantized original with "
                               f"{INSTEAD.split(' on ')[0]} --group-size 128")
    return int(group)


def plan(qc: dict, tensors: dict, cfg_path: Path) -> tuple[dict, dict, dict[str, AwqLinear]]:
    """Rewrite an AWQ GEMM checkpoint's tensor index: each linear's ``qweight``/``qzeros``/``scales`` become one
    float32 ``weight`` entry read as its exact dequantization. Returns ``(tensors, record, linears)``, ``linears``
    by weight name (what :func:`int4_weights` hands the INT4 stage)."""
    group = _config(qc, cfg_path)
    out = dict(tensors)
    linears: dict[str, AwqLinear] = {}
    for name in sorted(n for n in tensors if n.endswith(".qweight")):
        base = name[: -len(".qweight")]
        parts = {p: tensors.get(f"{base}.{p}") for p in _PARTS}
        missing = [f"{base}.{p}" for p, e in parts.items() if e is None]
        if missing:
            raise LlmcError(f"{tensors[name].file}: AWQ layer {base!r} has {name} but no {missing[0]}; the checkpoint "
                            "is incomplete (re-download it)")
        qw, qz, sc = parts["qweight"], parts["qzeros"], parts["scales"]
        k, n8 = qw.shape if len(qw.shape) == 2 else (0, 0)
        fits = (qw.dtype == "int32" and qz.dtype == "int32" and sc.dtype in ("float16", "bfloat16", "float32")
                and len(qw.shape) == 2 and k % group == 0 and tuple(qz.shape) == (k // group, n8)
                and tuple(sc.shape) == (k // group, 8 * n8))
        if not fits:
            raise LlmcError(f"{qw.file}: AWQ layer {base!r}: qweight {qw.dtype} {list(qw.shape)}, qzeros {qz.dtype} "
                            f"{list(qz.shape)}, scales {sc.dtype} {list(sc.shape)} do not fit AutoAWQ's GEMM layout "
                            f"with group_size {group} (int32 [K, N/8], int32 [K/G, N/8], float [K/G, N]); "
                            "config.json's quantization_config does not describe these weights")
        linear = AwqLinear(qw, qz, sc, group)
        weight = f"{base}.weight"
        out[weight] = replace(qw, name=weight, dtype="float32", shape=(linear.n, linear.k), nbytes=4 * linear.n * k,
                              derived=linear)
        for p in _PARTS:
            del out[f"{base}.{p}"]
        linears[weight] = linear
    if not linears:
        raise LlmcError(f"{cfg_path}: quantization_config says AWQ, but no tensor ends in .qweight; config.json does "
                        "not describe these weights")
    record = {"method": "awq", "version": "gemm", "bits": 4, "group_size": group, "zero_point": True,
              "linears": len(linears), "kept": "INT4 codes, zero points and scales as stored (never re-quantized)"}
    return out, record, linears


@dataclass
class CarriedInt4(SpilledInt4):
    """A checkpoint's INT4 weights handed to the INT4 stage as they are: a :class:`llmc.quant.int4.SpilledInt4`
    that reads them from the checkpoint instead of a spill file (the stage materialises one linear at a time)."""

    linear: AwqLinear | None = None

    def load(self) -> Int4Weights:
        return self.linear.load()


def carried(tensors: dict) -> dict[str, AwqLinear]:
    """The INT4 linears a checkpoint's tensor index carries (by weight name); empty for other checkpoints."""
    return {name: e.derived for name, e in tensors.items() if isinstance(getattr(e, "derived", None), AwqLinear)}


def int4_weights(linears: dict[str, AwqLinear]):
    """A :class:`llmc.quant.collect.CalibrationResult` whose linears carry the checkpoint's INT4 weights (no input
    scales: AutoAWQ folded its scales into the previous layers), for ``quantize_model``."""
    from llmc.quant.collect import CalibrationResult, LinearQuant

    return CalibrationResult(linears={
        name: LinearQuant(weights=CarriedInt4(path=None, n=lin.n, k=lin.k, group_size=lin.group_size, linear=lin))
        for name, lin in linears.items()})
