"""Which checkpoint tensor is which model weight, and the accounting that proves the match complete.

This module is the one place that maps safetensors keys to the parameters of the transformers model
(through transformers' own key renamings, its weight *converters* for parameters assembled from
several tensors, and tied embeddings). The frontend binds the traced graph's initializers with it,
and the quantization stage reads weights through :meth:`Binding.read` (handed to it by the build,
so ``quant`` never imports the compiler).

:func:`account` runs before tracing: every checkpoint tensor is bound to a weight or known to be
unused (rotary caches and masks that some checkpoints store), every weight of the model is found,
with the shape the config implies and a floating-point dtype. Otherwise the build stops with exit 2
naming a few tensors and the config field that probably disagrees: an engine built from weights
that do not fit its config is silently wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from llmc.compiler.checkpoint import Checkpoint
from llmc.compiler.safetensors_io import TensorEntry, read_tensor
from llmc.errors import LlmcError, UnsupportedError

# Tensors some checkpoints store that no model reads: rotary tables and causal-mask buffers saved by
# older code. transformers' own list for a model class (``_keys_to_ignore_on_load_unexpected``) is
# honoured as well.
KNOWN_UNUSED = (
    r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached|_cos_cached|_sin_cached)$",
    r"(^|\.)attn\.(bias|masked_bias)$",
    r"(^|\.)attention\.(bias|masked_bias)$",
)
_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
_SHOWN = 3  # how many tensor names one error line lists


@dataclass
class Binding:
    """``entries``: model state-dict name -> checkpoint tensor. ``merged``: names transformers assembles
    from several tensors -> (its WeightConverter, {source pattern: [TensorEntry, ...]}), in its loading
    order. ``unused``: checkpoint keys known not to be weights. ``unbound``: every other checkpoint key
    that no weight takes."""

    hf: object
    entries: dict[str, TensorEntry]
    merged: dict[str, tuple[object, dict[str, list[TensorEntry]]]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unbound: list[str] = field(default_factory=list)
    _alias_map: dict[str, list[str]] | None = field(default=None, repr=False)

    @property
    def needs_converter(self) -> bool:
        """Whether some weight is assembled by a transformers converter (e.g. per-expert MoE tensors)."""
        return bool(self.merged)

    def source(self, name: str) -> TensorEntry | None:
        """The checkpoint tensor of the state-dict entry ``name`` (None if assembled or absent)."""
        entry = self.entries.get(name)
        if entry is None:
            # A tied parameter is stored once, under its source's key: transformers' own {target: source} map
            # (output embeddings, and the ties a family always makes, e.g. BERT's decoder bias).
            tied = (getattr(self.hf, "all_tied_weights_keys", None) or {}).get(name)
            if tied is not None and tied != name:
                entry = self.entries.get(tied)
        if entry is None:
            # A module shared by several paths (the same parameter under two names) is stored under one of them.
            for alias in self._aliases().get(name, ()):
                entry = self.entries.get(alias)
                if entry is not None:
                    break
        if entry is None and getattr(self.hf.config, "tie_word_embeddings", False):
            # A tied output embedding is stored once, under the input embedding's key.
            out_emb, in_emb = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
            names = {id(p): n for n, p in self.hf.named_parameters(remove_duplicate=False)}
            if out_emb is not None and names.get(id(out_emb.weight)) == name:
                entry = self.entries.get(next(n for n, p in self.hf.named_parameters() if p is in_emb.weight))
        return entry

    def _aliases(self) -> dict[str, list[str]]:
        """Parameter name -> the other names of the very same parameter (modules shared between paths)."""
        if self._alias_map is None:
            by_id: dict[int, list[str]] = {}
            for n, p in self.hf.named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), []).append(n)
            self._alias_map = {n: [m for m in names if m != n] for names in by_id.values() if len(names) > 1
                               for n in names}
        return self._alias_map

    def read(self, name: str) -> np.ndarray:
        """The weight ``name`` as float32, read from disk (merged weights assembled from their sources)."""
        entry = self.source(name)
        if entry is not None:
            return np.asarray(read_tensor(entry), np.float32)
        if name in self.merged:
            return _convert(name, *self.merged[name], self.hf)
        raise RuntimeError(f"no checkpoint tensor for parameter {name!r}")  # account() ran: a bug


def bind(checkpoint: Checkpoint, hf) -> Binding:
    """Map every checkpoint tensor to the transformers model ``hf``'s state dict (nothing is read)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    # Values must not be None: transformers adds or strips the base-model prefix ("model.") only for
    # keys it finds here with a value.
    meta = dict.fromkeys(hf.state_dict(), True)
    prefix = hf.base_model_prefix
    ignore = [*KNOWN_UNUSED, *(getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or [])]
    out = Binding(hf, {})
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        entry = checkpoint.tensors[key]
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is not None:  # one of several source tensors of a merged weight: which converter?
            for converter in converters:
                target, pattern = rename_source_key(key, renamings, [converter], prefix, meta)
                if pattern is not None:
                    out.merged.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(entry)
                    break
            continue
        if renamed in meta:
            out.entries[renamed] = entry
        elif key in meta:  # a renaming that does not apply to a key already named as the model names it
            out.entries[key] = entry  # (DeepSeek V4's final norm: 'model.norm.weight')
        elif any(re.search(p, key) for p in ignore):
            out.unused.append(key)
        else:
            out.unbound.append(key)
    return out


def param_reader(checkpoint: Checkpoint) -> Callable[[object], Callable[[str], np.ndarray]]:
    """For calibration: a function of a transformers model giving ``name -> float32 array``. A weight
    transformers builds from several tensors is assembled on demand from only its own sources, so
    calibration still reads one layer at a time."""

    def for_model(model) -> Callable[[str], np.ndarray]:
        return bind(checkpoint, model).read

    return for_model


def account(checkpoint: Checkpoint, binding: Binding) -> None:
    """Raise :class:`LlmcError` (exit 2) unless the checkpoint and the model's weights match one to one."""
    hf, cfg_file = binding.hf, checkpoint.path / "config.json"
    state = hf.state_dict()
    parameters = [n for n, _ in hf.named_parameters(remove_duplicate=False)]
    missing = [n for n in parameters if binding.source(n) is None and n not in binding.merged]
    splits = sorted({src for converter, sources in binding.merged.values()
                     if len(getattr(converter, "target_patterns", None) or ()) > 1 for src in sources})
    if missing and splits:  # one stored tensor, several weights of the model (HRM's fused gate/q/k/v)
        raise UnsupportedError(
            f"{checkpoint.path}: llmc does not lower checkpoints whose tensors transformers splits into several "
            f"weights when it loads them ({_few(splits)} -> {_few(missing)}); llmc binds a weight to one tensor or "
            "assembles it from several, not the reverse")
    if missing:
        raise LlmcError(
            f"{checkpoint.path}: the model that config.json describes needs {_few(missing)} but no safetensors "
            f"file holds {'it' if len(missing) == 1 else 'them'}; {_hint(checkpoint, missing, 'missing')}")
    extra = binding.unbound + [n for n in binding.merged if n not in state]
    if extra:
        raise LlmcError(
            f"{checkpoint.path}: {len(extra)} checkpoint tensor{'s' if len(extra) > 1 else ''} that the model "
            f"config.json describes does not use: {_few(extra)}; {_hint(checkpoint, extra, 'extra')}")
    for name, entry in binding.entries.items():
        want = tuple(state[name].shape)
        if tuple(entry.shape) != want:
            raise LlmcError(
                f"{entry.file}: tensor {entry.name!r} has shape {list(entry.shape)} but config.json implies "
                f"{list(want)}; the weights do not belong to this config: "
                f"{_shape_hint(checkpoint.config, entry.shape, want)}")
        if state[name].is_floating_point() and entry.dtype not in _FLOAT_DTYPES:
            raise LlmcError(
                f"{entry.file}: tensor {entry.name!r} is {entry.dtype} where the model has a floating-point weight; "
                f"a quantized or foreign checkpoint? (check quantization_config in {cfg_file.name}); llmc reads "
                "float32, float16 and bfloat16 weights")


def _few(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def _layer_indices(names: Iterable[str]) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))}


def _config_value(config: dict, *names: str) -> tuple[str, object] | None:
    for name in names:
        if name in config:
            return name, config[name]
    return None


def _whole_layers(named: set[int], held: set[int], configured: object, kind: str) -> bool:
    """Whether the ``kind`` (missing / extra) tensors are whole layers beyond what the checkpoint holds or
    the config asks for: then the layer count is to blame, not one tensor of a layer."""
    if not named:
        return False
    if kind == "missing":
        return min(named) > max(held)
    return isinstance(configured, int) and min(named) >= configured


def _hint(checkpoint: Checkpoint, names: list[str], kind: str) -> str:
    """The config field that probably disagrees with the tensors ``names`` (missing or extra)."""
    config = checkpoint.config
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    held = _layer_indices(checkpoint.tensors)
    if layers and held and _whole_layers(_layer_indices(names), held, layers[1], kind):
        field_name, value = layers
        return (f"config.json field {field_name!r} is {value} and the checkpoint holds layers {min(held)}..{max(held)}"
                f" ({max(held) + 1} layers): fix {field_name!r} or use the checkpoint it was saved with")
    if kind == "missing" and any("lm_head" in n or "embed_out" in n for n in names):
        return (f"config.json field 'tie_word_embeddings' is {config.get('tie_word_embeddings')!r}: set it to true "
                "if the output projection shares the input embedding, or add the missing tensor")
    if any(n.endswith(".bias") for n in names):
        fields = {k: v for k, v in config.items() if "bias" in k and isinstance(v, bool)}
        if fields:
            listed = ", ".join(f"{k}={v}" for k, v in fields.items())
            return f"check config.json's bias switches ({listed}) against the checkpoint's bias tensors"
    experts = _config_value(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts and any("expert" in n for n in names):
        return f"check config.json field {experts[0]!r} ({experts[1]}) against the checkpoint's expert tensors"
    return (f"the checkpoint is incomplete or for another architecture than model_type "
            f"{config.get('model_type')!r}; check config.json against the checkpoint it came with")


def _shape_hint(config: dict, have: tuple[int, ...], want: tuple[int, ...]) -> str:
    """Name the config fields that set the dimensions where ``have`` and ``want`` differ."""
    sizes = _dimension_fields(config)
    parts = []
    for got, expected in zip(have, want, strict=False):
        if got != expected:
            fields = [name for name, value in sizes if value == expected]
            if fields:
                parts.append(f"{' or '.join(fields)} gives {expected}, the checkpoint has {got}")
    if len(have) != len(want) or not parts:
        return ("check hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size and "
                "vocab_size in config.json")
    return "check config.json: " + "; ".join(parts)


def _dimension_fields(config: dict) -> list[tuple[str, int]]:
    """(field or product of fields, value) for the config entries that set weight dimensions."""
    out = [(k, v) for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)]
    heads = _config_value(config, "num_attention_heads", "n_head")
    hidden = _config_value(config, "hidden_size", "n_embd")
    head_dim = config.get("head_dim") or (hidden[1] // heads[1] if heads and hidden and heads[1] else None)
    if heads and head_dim:
        out.append((f"{heads[0]} x head_dim", heads[1] * head_dim))
        kv = config.get("num_key_value_heads")
        if kv:
            out.append(("num_key_value_heads x head_dim", kv * head_dim))
        elif "num_key_value_heads" in config:  # transformers reads null as one key/value head per query head
            out.append(("num_key_value_heads (null: as many as num_attention_heads) x head_dim", heads[1] * head_dim))
    return out


def _convert(name: str, converter, sources: dict[str, list[TensorEntry]], model) -> np.ndarray:
    """One merged weight: the converter's operations (e.g. stack the experts, concatenate gate and up)
    applied to its source tensors, as float32 numpy."""
    import torch

    tensors = {pattern: [torch.from_numpy(np.array(read_tensor(e), np.float32, copy=True)) for e in entries]
               for pattern, entries in sources.items()}
    for op in converter.operations:
        tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                             target_patterns=converter.target_patterns, full_layer_name=name, model=model,
                             config=model.config, missing_keys=None)
    if len(tensors) != 1:
        raise RuntimeError(f"transformers' converter for {name!r} gives {len(tensors)} tensors "
                           f"({', '.join(tensors)}); llmc handles converters that give one")
    (value,) = tensors.values()
    return value.detach().float().numpy()
