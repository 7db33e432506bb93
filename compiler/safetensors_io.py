"""Reading safetensors files: a file's header as an index of tensor entries, and one tensor's values.

Memory-mapped and streamed: a tensor is read when a later stage needs it, never the whole checkpoint at once.
An entry may stand for a value computed on read: an FP8-stored weight is dequantized exactly (set up by
compiler/prequantized.py), a derived weight computed from other tensors (compiler/prequantized_int4.py).
"""

from __future__ import annotations

import errno
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError, os_fault, os_fault_errno

_ST_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",  # pre-quantized checkpoints only (compiler/prequantized.py)
}
_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype name (numpy-style), shape, byte offset and length in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    # A pre-quantized FP8 weight (compiler/prequantized.py): stored E4M3, read as float32 codes x scales.
    fp8_scale: object | None = None
    # A weight computed from other tensors of the checkpoint (compiler/prequantized_int4.py: an INT4 layer's exact
    # dequantization), read as ``derived.read()``.
    derived: object | None = None


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The index of one safetensors file: every tensor's entry, checked against the file's size."""
    try:
        return _read_header(path)
    except OSError as exc:  # deleted or made unreadable since the directory was listed
        raise changed_during_build(path, exc) from None


def _read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise LlmcError(f"{path}: truncated safetensors file ({size} bytes); re-download or re-save it")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8 or header_len > 100 * 2**20:
            raise LlmcError(
                f"{path}: corrupt safetensors header (declares {header_len} header bytes, file has {size}); "
                "re-download or re-save the checkpoint"
            )
        try:
            header = json.loads(fh.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LlmcError(f"{path}: corrupt safetensors header ({exc}); re-download or re-save it") from None
    base = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype not in _ST_DTYPES:
            raise UnsupportedError(f"{path}: tensor {name!r} has dtype {dtype!r}, which llmc cannot read")
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(x) for x in info["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * _ST_ITEMSIZE[dtype]
        if end - start != expected or base + end > size:
            raise LlmcError(
                f"{path}: tensor {name!r} needs bytes {start}..{end} of the data section but the file ends at "
                f"{size - base}: the file is truncated or corrupt; re-download or re-save it"
            )
        entries[name] = TensorEntry(name, path, _ST_DTYPES[dtype], shape, base + start, end - start)
    return entries


def changed_during_build(path: Path, exc: Exception) -> LlmcError:
    """A checkpoint file that vanished, shrank or became unreadable after llmc listed it, as one line."""
    if isinstance(exc, OSError) and os_fault_errno(exc) not in (None, errno.ENOENT):
        return os_fault(exc, path, "reading the checkpoint", elsewhere="copy it where this user can read it")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return LlmcError(f"{path}: vanished or changed while llmc was building from it ({reason}); leave the checkpoint "
                     "in place and unchanged until the build finishes, then run it again")


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """Read one tensor from disk (memory-mapped); bfloat16 is returned as float32."""
    if entry.derived is not None:
        return entry.derived.read()
    try:
        mm = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.offset, shape=(entry.nbytes,))
    except (OSError, ValueError) as exc:  # ValueError: the file is now shorter than its header said
        raise changed_during_build(entry.file, exc) from None
    if entry.fp8_scale is not None:
        import ml_dtypes

        codes = np.frombuffer(mm, dtype=ml_dtypes.float8_e4m3fn).reshape(entry.shape).astype(np.float32)
        return dequantize_fp8(codes, read_tensor(entry.fp8_scale.scale), entry.fp8_scale.block)
    if entry.dtype == "bfloat16":
        u16 = np.frombuffer(mm, dtype=np.uint16).astype(np.uint32) << 16
        return u16.view(np.float32).reshape(entry.shape)
    return np.frombuffer(mm, dtype=np.dtype(entry.dtype)).reshape(entry.shape)


def dequantize_fp8(codes, scales, block: tuple[int, int] | None):
    """``codes`` float32 ``[N, K]`` (E4M3 values) times ``scales`` (scalar, ``[N]``/``[N, 1]``, or blocks)."""
    scales = np.asarray(scales, np.float32)
    if block is None:
        s = scales.reshape(-1, 1) if scales.size == codes.shape[0] and scales.size > 1 else scales.reshape(())
        return (codes * s).astype(np.float32)
    rows = np.repeat(scales, block[0], axis=0)[: codes.shape[0]]
    full = np.repeat(rows, block[1], axis=1)[:, : codes.shape[1]]
    return (codes * full).astype(np.float32)
