"""Pre-quantized INT4 checkpoints carried exactly: AutoAWQ GEMM, GPTQ (v1, v2) and compressed-tensors
``pack-quantized``.

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

A GPTQ checkpoint (``quant_method`` ``gptq``, AutoGPTQ / GPTQModel layout) stores ``m.qweight`` int32 ``[K / 8, N]``
(code of input row ``8 r + j`` in bits ``4 j .. 4 j + 3`` of row ``r``), ``m.qzeros`` int32 ``[G, N / 8]`` (zero
points packed along N in the same sequential order), float16 ``m.scales`` ``[G, N]`` and ``m.g_idx`` int32 ``[K]``
(the group of each input row); its reference dequantization is ``W^T[k, n] = s[g_idx[k], n] * (q[k, n] -
z[g_idx[k], n])``, where ``checkpoint_format`` ``gptq`` (v1) stores ``z - 1`` and ``gptq_v2`` stores ``z``. Carried
exactly when ``g_idx[k] = k // group_size`` (groups in input order); refused: act-order (``desc_act``, or any
other ``g_idx``: the layer's input would need a permutation llmc does not apply yet), v1 zero points stored as 15
(a zero point of 0 that AutoGPTQ's v1 packing wrapped to -1: it does not fit 4 bits), bits other than 4, group sizes
other than 32/64/128 (``-1``: one group per row).

A compressed-tensors ``pack-quantized`` checkpoint (4-bit ``int`` weights, ``group`` strategy) stores
``m.weight_packed`` int32 ``[N, K / 8]`` (signed codes plus 8, element ``8 c + j`` of a row in nibble ``j`` of word
``c``), ``m.weight_scale`` ``[N, K / G]`` and, when asymmetric, ``m.weight_zero_point`` int32 ``[N / 8, K / G]``
(signed zero points plus 8, packed along N); its reference dequantization is ``(q - z) * s`` on the signed values,
which is the difference of the stored ones: carried as codes ``q + 8`` with zero points ``z + 8`` (8 when
symmetric). ``m.weight_shape`` is checked and dropped.
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


class Int4Source:
    """A checkpoint linear whose INT4 weights llmc carries: ``load()`` gives them, ``read()`` their exact float32
    dequantization (what the rest of the build reads as the layer's weight)."""

    def load(self) -> Int4Weights:
        raise NotImplementedError

    def read(self) -> np.ndarray:
        return self.load().dequantize()


@dataclass(frozen=True)
class AwqLinear(Int4Source):
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

    def load(self) -> Int4Weights:
        """:class:`llmc.quant.int4.Int4Weights` ``[N, K]`` with the checkpoint's codes, zero points and scales."""
        from llmc.compiler.safetensors_io import read_tensor

        return unpack(read_tensor(self.qweight), read_tensor(self.qzeros), read_tensor(self.scales), self.group_size)


@dataclass(frozen=True)
class GptqLinear(Int4Source):
    """One GPTQ linear's checkpoint tensors (TensorEntry each; g_idx checked to be ``k // group_size``)."""

    qweight: object
    qzeros: object
    scales: object
    group_size: int
    v1: bool  # checkpoint_format "gptq": zero points stored minus one

    @property
    def n(self) -> int:
        return int(self.scales.shape[1])

    @property
    def k(self) -> int:
        return 8 * int(self.qweight.shape[0])

    def load(self) -> Int4Weights:
        from llmc.compiler.safetensors_io import read_tensor

        return unpack_gptq(read_tensor(self.qweight), read_tensor(self.qzeros), read_tensor(self.scales),
                           self.group_size, self.v1)


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


def sequential_nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """uint8 codes of int32 words packed 8 per word in order (nibble ``j`` = element ``8 i + j``) along ``axis``."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    parts = [(words >> np.uint32(4 * j)) & np.uint32(0xF) for j in range(8)]
    stacked = np.stack(parts, axis=axis + 1).astype(np.uint8)  # [..., i, j, ...]
    shape = list(words.shape)
    shape[axis] *= 8
    return stacked.reshape(shape)


def unpack_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int,
                v1: bool) -> Int4Weights:
    """GPTQ tensors (groups in input order) -> :class:`llmc.quant.int4.Int4Weights` ``[N, K]``."""
    codes = sequential_nibbles(qweight, 0)  # [K, N]
    zeros = sequential_nibbles(qzeros, 1)  # [G, N]
    if v1:
        if (zeros == 15).any():
            raise ValueError("a GPTQ v1 zero point is stored as 15 (zero point 0 wrapped to -1)")
        zeros = zeros + 1
    return Int4Weights(q=np.ascontiguousarray(codes.T), scales=np.ascontiguousarray(scales.astype(np.float32).T),
                       zero_points=np.ascontiguousarray(zeros.T).astype(np.uint8), group_size=group_size,
                       k=int(codes.shape[0]))


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


GPTQ_INSTEAD = "--quant int4-gptq"


def _gptq_config(qc: dict, cfg_path: Path) -> tuple[int, bool]:
    """(group size, v1) of a GPTQ ``quantization_config``; refuses what llmc cannot carry exactly."""
    bits, group = qc.get("bits"), qc.get("group_size")
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    where = f"{cfg_path}: quantization_config (GPTQ"
    if bits != 4:
        raise UnsupportedError(f"{where} bits {bits!r}): llmc carries 4-bit GPTQ weights only; build from the "
                               f"unquantized original with {GPTQ_INSTEAD}")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedError(f"{where} checkpoint_format {fmt!r}): llmc carries the gptq (v1) and gptq_v2 layouts; "
                               f"build from the unquantized original with {GPTQ_INSTEAD}")
    if group not in GROUP_SIZES:
        raise UnsupportedError(f"{where} group_size {group!r}): llmc's INT4 kernels run groups of "
                               f"{', '.join(map(str, GROUP_SIZES))}; build from the unquantized original with "
                               f"{GPTQ_INSTEAD} --group-size 128")
    if qc.get("desc_act"):
        raise UnsupportedError(f"{where} desc_act true): act-order groups would need each layer's input permuted, "
                               f"which llmc does not do yet; build from the unquantized original with {GPTQ_INSTEAD}")
    return int(group), fmt == "gptq"


def plan_gptq(qc: dict, tensors: dict, cfg_path: Path) -> tuple[dict, dict, dict[str, GptqLinear]]:
    """As :func:`plan`, for a GPTQ checkpoint (``qweight``/``qzeros``/``scales``/``g_idx`` per linear). Checks every
    layer's ``g_idx`` (groups in input order) and, for v1, its stored zero points (they must fit 4 bits)."""
    from llmc.compiler.safetensors_io import read_tensor

    group, v1 = _gptq_config(qc, cfg_path)
    out = dict(tensors)
    linears: dict[str, GptqLinear] = {}
    for name in sorted(n for n in tensors if n.endswith(".qweight")):
        base = name[: -len(".qweight")]
        parts = {p: tensors.get(f"{base}.{p}") for p in (*_PARTS, "g_idx")}
        missing = [f"{base}.{p}" for p, e in parts.items() if e is None]
        if missing:
            raise LlmcError(f"{tensors[name].file}: GPTQ layer {base!r} has {name} but no {missing[0]}; the "
                            "checkpoint is incomplete (re-download it)")
        qw, qz, sc, gi = parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"]
        k8, n = qw.shape if len(qw.shape) == 2 else (0, 0)
        k = 8 * k8
        fits = (qw.dtype == "int32" and qz.dtype == "int32" and sc.dtype in ("float16", "bfloat16", "float32")
                and k % group == 0 and tuple(qz.shape) == (k // group, n // 8) and tuple(sc.shape) == (k // group, n)
                and tuple(gi.shape) == (k,) and n % 8 == 0)
        if not fits:
            raise LlmcError(f"{qw.file}: GPTQ layer {base!r}: qweight {qw.dtype} {list(qw.shape)}, qzeros {qz.dtype} "
                            f"{list(qz.shape)}, scales {sc.dtype} {list(sc.shape)}, g_idx {list(gi.shape)} do not fit "
                            f"GPTQ's layout with group_size {group} (int32 [K/8, N], int32 [K/G, N/8], float [K/G, N], "
                            "[K]); config.json's quantization_config does not describe these weights")
        if not np.array_equal(read_tensor(gi).astype(np.int64), np.arange(k) // group):
            raise UnsupportedError(f"{gi.file}: GPTQ layer {base!r}: g_idx is not k // group_size (act-order groups); "
                                   "each layer's input would need a permutation, which llmc does not apply yet; build "
                                   f"from the unquantized original with {GPTQ_INSTEAD}")
        if v1 and (sequential_nibbles(read_tensor(qz), 1) == 15).any():
            raise UnsupportedError(f"{qz.file}: GPTQ layer {base!r}: a v1 zero point is stored as 15 (a zero point of "
                                   "0 that v1's 'zero - 1' wrapped), which does not fit 4 bits; use the gptq_v2 "
                                   f"export, or build from the unquantized original with {GPTQ_INSTEAD}")
        linear = GptqLinear(qw, qz, sc, group, v1)
        weight = f"{base}.weight"
        out[weight] = replace(qw, name=weight, dtype="float32", shape=(n, k), nbytes=4 * n * k, derived=linear)
        for p in (*_PARTS, "g_idx"):
            del out[f"{base}.{p}"]
        linears[weight] = linear
    if not linears:
        raise LlmcError(f"{cfg_path}: quantization_config says GPTQ, but no tensor ends in .qweight; config.json does "
                        "not describe these weights")
    record = {"method": "gptq", "version": "v1" if v1 else "v2", "bits": 4, "group_size": group, "zero_point": True,
              "linears": len(linears), "kept": "INT4 codes, zero points and scales as stored (never re-quantized)"}
    return out, record, linears


@dataclass(frozen=True)
class PackedLinear(Int4Source):
    """One compressed-tensors pack-quantized linear (TensorEntry each; ``zero_point`` None when symmetric)."""

    packed: object
    scale: object
    zero_point: object | None
    group_size: int

    @property
    def n(self) -> int:
        return int(self.packed.shape[0])

    @property
    def k(self) -> int:
        return 8 * int(self.packed.shape[1])

    def load(self) -> Int4Weights:
        from llmc.compiler.safetensors_io import read_tensor

        codes = sequential_nibbles(read_tensor(self.packed), 1)  # [N, K]: signed codes + 8
        zp = (sequential_nibbles(read_tensor(self.zero_point), 0)[: self.n] if self.zero_point is not None
              else np.full((self.n, self.k // self.group_size), 8, np.uint8))
        scales = read_tensor(self.scale).astype(np.float32).reshape(self.n, -1)
        return Int4Weights(q=codes, scales=np.ascontiguousarray(scales), zero_points=np.ascontiguousarray(zp),
                           group_size=self.group_size, k=self.k)


CT_INSTEAD = "--quant int4 (or int4-awq / int4-gptq)"


def compressed_int4_group(qc: dict, cfg_path: Path) -> tuple[int, bool] | None:
    """(group size, symmetric) of a compressed-tensors config whose weights are 4-bit ints, None for other weights;
    refuses 4-bit int layouts llmc cannot carry exactly."""
    fmt = str(qc.get("format") or "")
    found = None
    for name, group in (qc.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "int" or w.get("num_bits") != 4:
            continue
        where = f"{cfg_path}: quantization_config (compressed-tensors group {name!r}"
        if fmt != "pack-quantized":
            raise UnsupportedError(f"{where}, format {fmt!r}): llmc carries 4-bit int weights in the pack-quantized "
                                   f"format only; build from the unquantized original with {CT_INSTEAD}")
        if w.get("strategy") != "group" or w.get("group_size") not in GROUP_SIZES or w.get("actorder"):
            raise UnsupportedError(f"{where}, strategy {w.get('strategy')!r}, group_size {w.get('group_size')!r}, "
                                   f"actorder {w.get('actorder')!r}): llmc carries groups of "
                                   f"{', '.join(map(str, GROUP_SIZES))} in input order only; build from the "
                                   f"unquantized original with {CT_INSTEAD}")
        this = (int(w["group_size"]), bool(w.get("symmetric", True)))
        if found is not None and found != this:
            raise UnsupportedError(f"{where}): config groups with different group sizes or symmetry; llmc carries one "
                                   f"INT4 layout per model; build from the unquantized original with {CT_INSTEAD}")
        found = this
    return found


def plan_compressed(qc: dict, tensors: dict, cfg_path: Path) -> tuple[dict, dict, dict[str, PackedLinear]]:
    """As :func:`plan`, for compressed-tensors ``pack-quantized`` 4-bit weights."""
    group, symmetric = compressed_int4_group(qc, cfg_path)
    out = dict(tensors)
    linears: dict[str, PackedLinear] = {}
    for name in sorted(n for n in tensors if n.endswith(".weight_packed")):
        base = name[: -len(".weight_packed")]
        packed, scale = tensors[name], tensors.get(f"{base}.weight_scale")
        zp = tensors.get(f"{base}.weight_zero_point")
        if scale is None or (zp is None and not symmetric):
            missing = f"{base}.weight_scale" if scale is None else f"{base}.weight_zero_point"
            raise LlmcError(f"{packed.file}: compressed-tensors layer {base!r} has {name} but no {missing}; the "
                            "checkpoint is incomplete (re-download it)")
        n, k8 = packed.shape if len(packed.shape) == 2 else (0, 0)
        k = 8 * k8
        fits = (packed.dtype == "int32" and k % group == 0 and n > 0
                and tuple(scale.shape) in ((n, k // group),) and scale.dtype in ("float16", "bfloat16", "float32")
                and (symmetric or (zp.dtype == "int32" and tuple(zp.shape) == (-(-n // 8), k // group))))
        if not fits:
            raise LlmcError(f"{packed.file}: compressed-tensors layer {base!r}: weight_packed {packed.dtype} "
                            f"{list(packed.shape)}, weight_scale {scale.dtype} {list(scale.shape)}"
                            + (f", weight_zero_point {zp.dtype} {list(zp.shape)}" if zp is not None else "")
                            + f" do not fit pack-quantized with group_size {group} (int32 [N, K/8], [N, K/G], int32 "
                            "[N/8, K/G]); config.json's quantization_config does not describe these weights")
        linear = PackedLinear(packed, scale, None if symmetric else zp, group)
        weight = f"{base}.weight"
        out[weight] = replace(packed, name=weight, dtype="float32", shape=(n, k), nbytes=4 * n * k, derived=linear)
        for p in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            out.pop(f"{base}.{p}", None)
        linears[weight] = linear
    if not linears:
        raise LlmcError(f"{cfg_path}: quantization_config says pack-quantized 4-bit weights, but no tensor ends in "
                        ".weight_packed; config.json does not describe these weights")
    record = {"method": "compressed-tensors", "version": "pack-quantized", "bits": 4, "group_size": group,
              "zero_point": not symmetric, "linears": len(linears),
              "kept": "INT4 codes, zero points and scales as stored (never re-quantized)"}
    return out, record, linears


@dataclass
class CarriedInt4(SpilledInt4):
    """A checkpoint's INT4 weights handed to the INT4 stage as they are: a :class:`llmc.quant.int4.SpilledInt4`
    that reads them from the checkpoint instead of a spill file (the stage materialises one linear at a time)."""

    linear: Int4Source | None = None

    def load(self) -> Int4Weights:
        return self.linear.load()


def carried(tensors: dict) -> dict[str, Int4Source]:
    """The INT4 linears a checkpoint's tensor index carries (by weight name); empty for other checkpoints."""
    return {name: e.derived for name, e in tensors.items() if isinstance(getattr(e, "derived", None), Int4Source)}


def int4_weights(linears: dict[str, Int4Source]):
    """A :class:`llmc.quant.collect.CalibrationResult` whose linears carry the checkpoint's INT4 weights (no input
    scales: AutoAWQ folded its scales into the previous layers; GPTQ has none), for ``quantize_model``."""
    from llmc.quant.collect import CalibrationResult, LinearQuant

    return CalibrationResult(linears={
        name: LinearQuant(weights=CarriedInt4(path=None, n=lin.n, k=lin.k, group_size=lin.group_size, linear=lin))
        for name, lin in linears.items()})
