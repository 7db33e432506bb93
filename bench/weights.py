"""The engine's side of the roofline: bytes a decode step reads, from its graph and manifest.

Each initializer and the ops that consume it are read from ``model.onnx`` without the onnx package (which the
runtime does not depend on); the KV bytes per token come from the manifest's KV layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError

# Ops whose weight input is read by row (embedding lookups), not streamed whole every step.
_GATHER_OPS = {"Gather", "GatherND", "GatherElements", "GatherBlockQuantized"}

# ONNX TensorProto.DataType -> bits per element.
_DTYPE_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 16: 16,
               17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}


@dataclass
class WeightBytes:
    """Bytes of an engine's weights, from its graph. ``streamed`` is read once per forward step (every
    initializer a non-gather op consumes); ``gathered`` are embedding tables, of which a step reads
    ``row`` bytes per token; ``files`` is the size of the weight files on disk."""

    streamed: int
    gathered: int
    row: int
    files: int
    initializers: int


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """Protocol-buffer fields in ``buf[start:end]``: (number, wire type, value or (start, end) span)."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield num, wire, value
        elif wire == 2:
            n, i = _varint(buf, i)
            yield num, wire, (i, i + n)
            i += n
        elif wire == 1:
            yield num, wire, None
            i += 8
        elif wire == 5:
            yield num, wire, None
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _tensor_bytes(buf: memoryview, span: tuple[int, int]) -> tuple[str, int, list[int]]:
    """(name, bytes, dims) of an ONNX TensorProto, external or inline."""
    name, dims, dtype, raw, external, typed = "", [], 1, None, {}, 0
    for num, wire, v in _fields(buf, *span):
        if num == 1:  # dims: packed or not
            if wire == 2:
                i, end = v
                while i < end:
                    d, i = _varint(buf, i)
                    dims.append(d)
            else:
                dims.append(v)
        elif num == 2:
            dtype = v
        elif num == 8:
            name = bytes(buf[v[0]:v[1]]).decode()
        elif num == 9:
            raw = v[1] - v[0]
        elif num in (4, 5, 7, 10, 11) and wire == 2:  # packed typed data: bytes on the wire ~ bytes in memory
            typed += v[1] - v[0]
        elif num == 13:
            entry = dict(_fields_kv(buf, v))
            external[entry.get("key", "")] = entry.get("value", "")
    count = int(np.prod(dims)) if dims else 1
    if "length" in external:
        size = int(external["length"])
    elif raw is not None:
        size = raw
    elif typed:
        size = typed
    else:
        size = count * _DTYPE_BITS.get(dtype, 32) // 8
    return name, size, dims


def _fields_kv(buf: memoryview, span: tuple[int, int]):
    for num, _, s in _fields(buf, *span):
        if num in (1, 2):
            yield ("key" if num == 1 else "value"), bytes(buf[s[0]:s[1]]).decode()


def weight_bytes(engine_dir: str | Path, manifest: dict) -> WeightBytes:
    """Classify the bytes of every initializer of the engine's graph by how a forward step reads them."""
    root = Path(engine_dir)
    model_path = root / manifest["engine"]["model_file"]
    buf = memoryview(model_path.read_bytes())
    graph = next((v for num, wire, v in _fields(buf, 0, len(buf)) if num == 7 and wire == 2), None)
    if graph is None:
        raise LlmcError(f"{model_path}: no graph in this ONNX file; the artifact is corrupt, rebuild it")
    inits: dict[str, tuple[int, list[int]]] = {}
    consumers: dict[str, set[str]] = {}
    for num, wire, v in _fields(buf, *graph):
        if num == 5 and wire == 2:
            name, size, dims = _tensor_bytes(buf, v)
            inits[name] = (size, dims)
        elif num == 1 and wire == 2:
            inputs, op = [], ""
            for n2, _, s in _fields(buf, *v):
                if n2 == 1:
                    inputs.append(bytes(buf[s[0]:s[1]]).decode())
                elif n2 == 4:
                    op = bytes(buf[s[0]:s[1]]).decode()
            for name in inputs:
                consumers.setdefault(name, set()).add(op)
    streamed = gathered = row = 0
    for name, (size, dims) in inits.items():
        ops = consumers.get(name, set())
        if ops and ops <= _GATHER_OPS:
            gathered += size
            if len(dims) >= 2:  # a table (or its per-row scales); scalars and index vectors are not read by row
                row += size // max(dims[0], 1)
        else:
            streamed += size
    files = {manifest["engine"].get("weights_file")} | {p.name for p in root.glob("*.data")}
    file_bytes = sum((root / f).stat().st_size for f in files if f and (root / f).is_file())
    return WeightBytes(streamed, gathered, row, file_bytes, len(inits))


def kv_bytes_per_token(manifest: dict) -> int:
    """Bytes of K and V that one token of context occupies across all layers."""
    kv = manifest["kv_cache"]
    if kv["dtype"] in ("float8_e4m3fn", "fp8", "float8"):
        itemsize = 1
    else:
        itemsize = np.dtype(kv["dtype"]).itemsize
    from llmc.runtime.core.kv_cache import layer_geometry

    geometry = layer_geometry(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv.get("layers"))
    return 2 * sum(h * d for i, (owner, h, d) in enumerate(geometry) if owner == i) * itemsize
