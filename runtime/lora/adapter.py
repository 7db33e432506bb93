"""Multi-LoRA at run time: PEFT adapters read from disk, resident in the engine's slots, chosen per request.

An engine built with ``--lora-slots S --max-lora-rank R`` (manifest ``lora``, see llmc.passes.lora) takes the
stacked adapters of its ``S`` slots as graph inputs, one ``A`` ``[in, S*R]`` and one ``B`` ``[S*R, out]`` per
linear, and a slot per token (0: the base model). :class:`~llmc.runtime.lora.slots.LoraSlots` owns those buffers;
this module reads the adapters:

- Adapters are registered by name (:meth:`LoraSlots.add`): read and checked in full when registered (a bad
  adapter is refused then, before any request runs), scaling folded into ``B`` (``lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` with rsLoRA), kept in host memory.
- A request for an adapter takes a slot when it is admitted (:meth:`LoraSlots.acquire`): the adapter's slot if
  it is resident, else a free slot, else the least recently used slot that no running request holds (its
  adapter is evicted: a copy into the buffers). With every slot held the request waits; it never fails.
- A slot's buffers change only while no running request holds it, so a step never sees an adapter change.

The reader takes PEFT's on-disk layout: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}


@dataclass(frozen=True)
class LoraModule:
    """One linear with LoRA slots (manifest ``lora.modules``)."""

    module: str
    in_features: int
    out_features: int
    a_input: str
    b_input: str


@dataclass(frozen=True)
class LoraSpec:
    """An engine's LoRA geometry (manifest ``lora``)."""

    slots: int
    max_rank: int
    targets: tuple[str, ...]
    slot_input: str
    modules: tuple[LoraModule, ...]

    @classmethod
    def from_manifest(cls, manifest: dict) -> LoraSpec | None:
        lora = manifest.get("lora")
        if not lora:
            return None
        return cls(int(lora["slots"]), int(lora["max_rank"]), tuple(lora["targets"]), lora["slot_input"],
                   tuple(LoraModule(**m) for m in lora["modules"]))


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: per module, ``A`` ``[r, in]`` and ``scaling * B`` ``[out, r]`` in float32."""

    name: str
    path: Path
    rank: int
    alpha: float
    rslora: bool
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    key: int  # the prefix cache's root hash for this adapter's sequences (never 0: that is the base model)


# -- reading PEFT files -------------------------------------------------------------------------------------

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file (float32/16/64 and bfloat16; bfloat16 through ml_dtypes)."""
    try:
        data = path.read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8: 8 + size])
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise LlmcError(f"{path}: not a readable safetensors file ({exc}); save the adapter with PEFT's "
                        "save_pretrained (safetensors)") from None
    body = memoryview(data)[8 + size:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        if dtype == "BF16":
            import ml_dtypes

            np_dtype = np.dtype(ml_dtypes.bfloat16)
        elif dtype in _DTYPES:
            np_dtype = np.dtype(_DTYPES[dtype])
        else:
            raise LlmcError(f"{path}: tensor {name!r} has dtype {dtype}; LoRA weights must be F32, F16 or BF16")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - start != np_dtype.itemsize * math.prod(shape):
            raise LlmcError(f"{path}: tensor {name!r}: its byte range does not match its shape {list(shape)}; the "
                            "file is damaged, save the adapter again")
        out[name] = np.frombuffer(body[start:end], np_dtype).reshape(shape).astype(np.float32)
    return out


def _config(path: Path) -> dict:
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise LlmcError(f"{file}: no such file; a LoRA adapter is a directory in PEFT's format "
                        f"({CONFIG_FILE} + {WEIGHTS_FILE}), as save_pretrained writes it") from None
    except (OSError, ValueError) as exc:
        raise LlmcError(f"{file}: not readable JSON ({exc}); write it with PEFT's save_pretrained") from None
    if not isinstance(config, dict):
        raise LlmcError(f"{file}: must hold a JSON object (PEFT's LoraConfig)")
    return config


def read_adapter(name: str, path: str | Path, spec: LoraSpec) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter against the engine's geometry.

    Raises ``UnsupportedError`` (exit 3) for what the engine cannot run (rank above its ``--max-lora-rank``,
    DoRA, ``modules_to_save``, LoRA biases, per-module rank/alpha patterns, modules it has no slots for) and
    ``LlmcError`` (exit 2) for malformed files and shapes that do not fit the base model."""
    root = Path(path)
    config = _config(root)
    rank, alpha, rslora, scaling = _check_config(root / CONFIG_FILE, config, spec)
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        extra = " (adapter_model.bin is PyTorch's pickle format: save with safe_serialization=True)" \
            if (root / "adapter_model.bin").is_file() else ""
        raise LlmcError(f"{weights_file}: no such file{extra}; a LoRA adapter needs its weights in safetensors")
    pairs = _lora_pairs(weights_file, _read_safetensors(weights_file), spec, config)
    by_module = {m.module: m for m in spec.modules}
    weights = {}
    for module, (a, b) in pairs.items():
        site = by_module[module]
        if a is None or b is None:
            raise LlmcError(f"{weights_file}: {module} has lora_{'B' if a is None else 'A'} without "
                            f"lora_{'A' if a is None else 'B'}; the file is incomplete")
        want_a, want_b = (rank, site.in_features), (site.out_features, rank)
        if a.shape != want_a or b.shape != want_b:
            raise LlmcError(f"{weights_file}: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the "
                            f"base model (expected {list(want_a)} / {list(want_b)} for r={rank}); the adapter was "
                            "trained for another model or another r")
        weights[module] = (np.ascontiguousarray(a), np.ascontiguousarray(b * np.float32(scaling)))
    # Never 0 (the base model's chain), the same for the same name and files' contents.
    key = zlib.crc32(weights_file.read_bytes(), zlib.crc32(name.encode())) | (1 << 40)
    return LoraAdapter(name, root, rank, float(alpha), rslora, scaling, weights, key)


def _check_config(file: Path, config: dict, spec: LoraSpec) -> tuple[int, float, bool, float]:
    """``(rank, lora_alpha, use_rslora, scaling)`` of an adapter config llmc's slots can run (else why not)."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise UnsupportedError(f"{file}: peft_type {peft_type!r}: llmc serves LoRA adapters only")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LlmcError(f"{file}: field 'r' must be a positive integer (the LoRA rank), got {rank!r}")
    if rank > spec.max_rank:
        raise UnsupportedError(f"{file}: r={rank} is above the engine's --max-lora-rank {spec.max_rank}; rebuild the "
                               f"engine with --max-lora-rank {rank} or more")
    if config.get("use_dora"):
        raise UnsupportedError(f"{file}: use_dora is true: llmc's LoRA slots have no DoRA magnitude vectors; serve "
                               "a plain LoRA adapter (or merge this one into the weights and build that)")
    if config.get("modules_to_save"):
        raise UnsupportedError(f"{file}: modules_to_save {config['modules_to_save']} replaces whole modules, which "
                               "llmc's LoRA slots cannot; train without modules_to_save, or merge the adapter into "
                               "the weights and build that")
    if config.get("bias", "none") not in ("none", None) or config.get("lora_bias"):
        raise UnsupportedError(f"{file}: bias {config.get('bias')!r} / lora_bias: llmc's LoRA slots carry no "
                               "biases; train with bias='none'")
    for field_name in ("rank_pattern", "alpha_pattern"):
        if config.get(field_name):
            raise UnsupportedError(f"{file}: {field_name} gives modules their own rank or alpha, which llmc does not "
                                   f"take yet; train with one r and lora_alpha")
    if config.get("fan_in_fan_out"):
        raise UnsupportedError(f"{file}: fan_in_fan_out is true (Conv1D weights); llmc's slots take nn.Linear "
                               "adapters")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LlmcError(f"{file}: field 'lora_alpha' must be a number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    scaling = float(alpha) / (math.sqrt(rank) if rslora else rank)
    return rank, alpha, rslora, scaling


def _lora_pairs(weights_file: Path, tensors: dict[str, np.ndarray], spec: LoraSpec, config: dict) -> dict[str, list]:
    """Module -> ``[lora_A, lora_B]`` (either may be missing: None) of the adapter's tensors."""
    by_module = {m.module: m for m in spec.modules}
    pairs: dict[str, list] = {}
    # LoRA matrices first: an adapter of a module without slots is named as such, not by the other tensors PEFT
    # saves beside them (a targeted lm_head's whole weight).
    for key, value in sorted(tensors.items(), key=lambda kv: not kv[0].endswith(tuple(_SUFFIXES))):
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None or not key.startswith(_PREFIX):
            raise UnsupportedError(f"{weights_file}: tensor {key!r} is not a LoRA A/B matrix of a linear layer "
                                   f"(base_model.model.<module>.lora_A.weight / lora_B.weight); llmc's slots take "
                                   "only those")
        module = key[len(_PREFIX): -len(suffix)]
        if module not in by_module:
            built = sorted({m.module.rsplit(".", 1)[-1] for m in spec.modules})
            if module.rsplit(".", 1)[-1] in built:  # a layer of that kind outside the slots' model: an encoder's
                raise UnsupportedError(
                    f"{weights_file}: the adapter targets {module}, outside the language model whose layers hold "
                    f"this engine's LoRA slots (e.g. {spec.modules[0].module}); llmc applies adapters to the "
                    "language model only (an image encoder keeps its weights): save the adapter with target_modules "
                    "limited to it, e.g. r'.*language_model.*\\.(q_proj|v_proj)'")
            raise UnsupportedError(f"{weights_file}: the adapter targets {module}, which this engine has no LoRA slots "
                                   f"for (built for {', '.join(built)}; target_modules "
                                   f"{config.get('target_modules')!r}); rebuild with --lora-targets covering it")
        pairs.setdefault(module, [None, None])[_SUFFIXES[suffix]] = value
    if not pairs:
        raise LlmcError(f"{weights_file}: holds no LoRA tensors (base_model.model.<module>.lora_A.weight); save the "
                        "adapter with PEFT's save_pretrained")
    return pairs
