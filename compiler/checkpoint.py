"""Load and validate a Hugging Face checkpoint directory without reading its weights.

Only the safetensors headers are parsed here; tensors are read later, one at a time, when the
backend writes the engine (see :func:`tensor_reader`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from llmc.compiler.config_check import check_config, check_field_types, check_tokenizer
from llmc.compiler.safetensors_io import TensorEntry, changed_during_build, read_header
from llmc.errors import LlmcError, UnsupportedError

# Architectures whose engines are tested against transformers end to end (tests/test_architectures.py).
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "mixtral",
    "qwen3_moe",
)

# How many of transformers' causal-LM model types the family sweep (scripts/family_sweep.py) builds into engines that
# match transformers: docs/family_sweep.json's "match" rows (tests/test_family_sweep.py holds the two equal).
SWEEP_MATCHES = 131


def supported_text() -> str:
    """What refusals say llmc builds: what the family sweep proves, not a fixed list."""
    return (f"{SWEEP_MATCHES} model types match transformers in llmc's family sweep (docs/family_sweep.md), among "
            f"them {', '.join(SUPPORTED_MODEL_TYPES)}")


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
    """Whether transformers has a causal-LM class for ``model_type``, or an image-text-to-text one whose text model
    the generic path traces inside the wrapper (compiler/multimodal.py)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def is_tested(model_type: str) -> bool:
    """Whether engines of ``model_type`` are tested against transformers in llmc's suite."""
    return model_type in SUPPORTED_MODEL_TYPES


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
    config = _read_config(cfg_path)
    _check_model_type(config, cfg_path)
    files = _weight_files(root)

    tensors: dict[str, TensorEntry] = {}
    for f in files:
        tensors.update(read_header(f))
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


def _read_config(cfg_path: Path) -> dict:
    """config.json as a dict whose ``model_type`` is a string and whose fields have their JSON types."""
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
            f"{cfg_path}: field 'model_type' is missing; add it ({supported_text()})"
        )
    if not isinstance(model_type, str):
        raise LlmcError(f"{cfg_path}: field 'model_type' is {json.dumps(model_type)}; it must be a string naming "
                        f"the architecture ({supported_text()})")
    check_field_types(config, cfg_path)
    return config


def _check_model_type(config: dict, cfg_path: Path) -> None:
    """Refuse a model type llmc cannot build (recurrent layers it does not lower, a mechanism no kernel runs, no
    causal-LM class in transformers); warn where it builds one its suite does not test."""
    model_type = config["model_type"]
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
            f"{supported_text()}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        from llmc.compiler.mechanisms import refuse_unlowered

        refuse_unlowered(config, model_type, cfg_path)
    if model_type not in SUPPORTED_MODEL_TYPES and not _is_causal_lm(model_type):
        raise UnsupportedError(
            f"{cfg_path}: model_type {model_type!r} has no causal-LM class in transformers, so llmc cannot build it; "
            f"{supported_text()}"
        )

    if model_type not in TESTED_MODEL_TYPES:
        logging.getLogger("llmc").warning(
            "%s: model_type %r is untested in llmc; building it through the generic path (the build's "
            "self-check holds a random twin of this config to transformers and stops if they differ). Tested: %s",
            cfg_path, model_type, ", ".join(TESTED_MODEL_TYPES),
        )


def _weight_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names (each must exist), else every file."""
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
    return files
