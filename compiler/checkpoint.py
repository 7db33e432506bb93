"""Load and validate a Hugging Face checkpoint directory without reading its weights.

Only the safetensors headers are parsed here; tensors are read later, one at a time, when the
backend writes the engine (see :func:`tensor_reader`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.compiler.config_check import check_config, check_field_types, check_tokenizer
from llmc.errors import LlmcError, UnsupportedError, os_fault, os_fault_errno

# Architectures whose engines are tested against transformers end to end (tests/test_architectures.py).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "mixtral",
    "qwen3_moe",
)

# Architectures whose layers keep recurrent state (state-space, linear attention, convolution caches): the
# KV design has pages of keys and values only, so they are refused before any work.
RECURRENT_MODEL_TYPES = (
    "mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "rwkv", "recurrent_gemma", "minimax", "xlstm",
)
# Hybrid architectures whose recurrent layers llmc lowers (llmc.plugins.recurrent; the runtime's state pool,
# llmc.runtime.state_cache), CPU and CUDA engines: model_type -> what those layers are (tests/test_hybrid_*.py).
HYBRID_MODEL_TYPES = {"lfm2": "short-convolution layers", "qwen3_next": "Gated DeltaNet layers",
                      "qwen3_5_text": "Gated DeltaNet layers", "nemotron_h": "Mamba2 layers",
                      "falcon_h1": "Mamba2 layers", "granitemoehybrid": "Mamba2 layers", "bamba": "Mamba2 layers",
                      "qwen3_5_moe_text": "Gated DeltaNet layers", "lfm2_moe": "short-convolution layers"}
# What a build does not warn about as untested: the supported types and the hybrids, each held to transformers by
# its own tests (tests/test_architectures.py, tests/test_hybrid_*.py).
TESTED_MODEL_TYPES = (*SUPPORTED_MODEL_TYPES, *HYBRID_MODEL_TYPES)
# The recurrent mechanism llmc still lacks, per refused family (named in the refusal); a family recognised by its
# fields only is named by _RECURRENT_BY_FIELD.
_SSM = "Mamba/Mamba2 selective state-space layers (SSD scan with a per-sequence SSM state, and their causal conv1d)"
_GDN = "Gated DeltaNet layers (the gated delta rule: a per-sequence [heads, key, value] recurrent state)"
RECURRENT_MECHANISMS = {
    "mamba": _SSM, "mamba2": _SSM, "falcon_mamba": _SSM, "jamba": _SSM, "zamba": _SSM, "zamba2": _SSM,
    "bamba": _SSM, "granitemoehybrid": _SSM, "falcon_h1": _SSM, "nemotron_h": _SSM,
    "qwen3_next": _GDN, "qwen3_5_text": _GDN, "qwen3_5_moe_text": _GDN,
    "kimi_linear": "Kimi Delta Attention layers (a gated delta rule with channel-wise gates)",
    "rwkv": "RWKV time-mixing recurrence", "recurrent_gemma": "RG-LRU recurrent layers",
    "minimax": "lightning (linear) attention layers", "xlstm": "xLSTM cells",
}
_RECURRENT_BY_FIELD = {"linear_conv_kernel_dim": _GDN}
_RECURRENT_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "conv_kernel",
                     "linear_conv_kernel_dim")

# The runtime's tokenizer (llmc.runtime.tokenizer reads this file only).
TOKENIZER_FILE = "tokenizer.json"

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


@dataclass
class Checkpoint:
    """A validated checkpoint directory: its config and an index of its tensors."""

    path: Path
    config: dict
    tensors: dict[str, TensorEntry]
    files: list[Path] = field(default_factory=list)
    # How a pre-quantized checkpoint was converted (compiler/prequantized.py), for report.json; None if plain.
    source_quantization: dict | None = None

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def has_tokenizer(self) -> bool:
        """Whether the checkpoint has ``tokenizer.json`` (the runtime's tokenizer); without it an engine
        takes token ids only."""
        return (self.path / TOKENIZER_FILE).is_file()

    @property
    def dtype(self) -> str:
        """The checkpoint's storage dtype as named in config.json (default float32)."""
        return str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32")

    def digest(self) -> str:
        """sha256 over every file that defines the model (config, weights, tokenizer), in name order."""
        h = hashlib.sha256()
        for f in sorted(self.path.iterdir()):
            if f.is_file() and (f.suffix in {".json", ".safetensors", ".model", ".txt", ".jinja"}):
                h.update(f.name.encode() + b"\0")
                try:
                    with open(f, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 22), b""):
                            h.update(chunk)
                except OSError as exc:
                    raise changed_during_build(f, exc) from None
        return "sha256:" + h.hexdigest()


def _is_causal_lm(model_type: str) -> bool:
    """Whether transformers has a causal-LM class for ``model_type`` (the generic path may trace it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_tested(model_type: str) -> bool:
    """Whether engines of ``model_type`` are tested against transformers in llmc's suite."""
    return model_type in SUPPORTED_MODEL_TYPES


def _read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
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


def _json_kind(value: object) -> str:
    """The JSON name of ``value``'s type, as a user who wrote the file would call it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "value")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Validate a checkpoint directory and index its tensors. Raises :class:`LlmcError` on bad input."""
    root = Path(path)
    if not root.exists():
        raise LlmcError(f"{root}: no such checkpoint directory; pass the folder that holds config.json")
    if not root.is_dir():
        raise LlmcError(f"{root}: not a directory; pass the folder that holds config.json")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise LlmcError(f"{cfg_path}: missing; a Hugging Face checkpoint folder needs config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise LlmcError(f"{cfg_path}: not valid JSON ({exc}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise LlmcError(f"{cfg_path}: holds a JSON {_json_kind(config)}, not an object of config fields; use the "
                        "config.json the model came with (it starts with '{')")
    model_type = config.get("model_type")
    if model_type is None:
        raise LlmcError(
            f"{cfg_path}: field 'model_type' is missing; add it (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if not isinstance(model_type, str):
        raise LlmcError(f"{cfg_path}: field 'model_type' is {json.dumps(model_type)}; it must be a string naming "
                        f"the architecture (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    check_field_types(config, cfg_path)
    recurrent = [f for f in _RECURRENT_FIELDS if f in config]
    if model_type in RECURRENT_MODEL_TYPES or (model_type not in SUPPORTED_MODEL_TYPES and recurrent
                                               and model_type not in HYBRID_MODEL_TYPES):
        why = f"field {recurrent[0]!r}" if recurrent else "its model type"
        mechanism = RECURRENT_MECHANISMS.get(model_type) or next(
            (_RECURRENT_BY_FIELD[f] for f in recurrent if f in _RECURRENT_BY_FIELD),
            "state-space, linear-attention or convolution layers")
        raise UnsupportedError(
            f"{cfg_path}: model_type {model_type!r} keeps recurrent state between tokens ({why}: {mechanism}); "
            f"llmc's state pool runs {', '.join(sorted(set(HYBRID_MODEL_TYPES.values())))} "
            f"({', '.join(HYBRID_MODEL_TYPES)}) but does not lower these yet, so it cannot build this model. "
            f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        from llmc.compiler.mechanisms import refuse_unlowered

        refuse_unlowered(config, model_type, cfg_path)
    if model_type not in SUPPORTED_MODEL_TYPES and not _is_causal_lm(model_type):
        raise UnsupportedError(
            f"{cfg_path}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )

    if model_type not in TESTED_MODEL_TYPES:
        logging.getLogger("llmc").warning(
            "%s: model_type %r is untested in llmc; building it through the generic path (the build's "
            "self-check holds a random twin of this config to transformers and stops if they differ). Tested: %s",
            cfg_path, model_type, ", ".join(TESTED_MODEL_TYPES),
        )

    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise LlmcError(f"{index_path}: unreadable ({exc}); it must hold a 'weight_map'") from None
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise LlmcError(f"{index_path}: names shard {f.name} which does not exist; re-download the shards")
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise LlmcError(f"{root}: no *.safetensors weights found; save the model with safe_serialization=True")

    tensors: dict[str, TensorEntry] = {}
    for f in files:
        tensors.update(_read_safetensors_header(f))
    from llmc.compiler import prequantized

    tensors, source_quant = prequantized.plan(config, tensors, cfg_path)
    check_config(config, cfg_path, list(tensors))
    checkpoint = Checkpoint(path=root, config=config, tensors=tensors, files=files, source_quantization=source_quant)
    if checkpoint.has_tokenizer:
        check_tokenizer(root / TOKENIZER_FILE, config, cfg_path)
    else:
        logging.getLogger("llmc").warning(
            "%s: no %s; the engine will take token ids, not text (llmc run ENGINE --prompt-ids 1,2,3); copy the "
            "model's tokenizer files into the checkpoint to build one that takes text", root, TOKENIZER_FILE)
    return checkpoint


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

        from llmc.compiler.prequantized import dequantize

        codes = np.frombuffer(mm, dtype=ml_dtypes.float8_e4m3fn).reshape(entry.shape).astype(np.float32)
        return dequantize(codes, read_tensor(entry.fp8_scale.scale), entry.fp8_scale.block)
    if entry.dtype == "bfloat16":
        u16 = np.frombuffer(mm, dtype=np.uint16).astype(np.uint32) << 16
        return u16.view(np.float32).reshape(entry.shape)
    return np.frombuffer(mm, dtype=np.dtype(entry.dtype)).reshape(entry.shape)
