"""config.json sanity, before any work: counts positive, heads dividing widths, experts and windows in range.

transformers accepts most nonsense here (``num_hidden_layers: -1`` builds a model with no layers,
which then ignores every weight), so llmc checks the fields that size the engine itself. Fields go
by the names the families use in config.json (GPT-2's ``n_layer`` / ``n_head`` / ``n_embd`` too);
a text model nested under ``text_config`` is checked as well. Nothing here imports transformers: a
cache hit runs this too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from llmc.errors import LlmcError

# Each entry: the config.json names one quantity goes by, first found wins.
_POSITIVE = (
    ("num_hidden_layers", "n_layer", "num_layers"),
    ("num_attention_heads", "n_head"),
    ("num_key_value_heads",),
    ("hidden_size", "n_embd", "d_model"),
    ("intermediate_size", "n_inner", "ffn_dim"),
    ("vocab_size",),
    ("head_dim",),
    ("max_position_embeddings", "n_positions"),
    ("sliding_window",),
    ("num_local_experts", "num_experts", "n_routed_experts"),
    ("num_experts_per_tok",),
    ("moe_intermediate_size",),
    ("kv_lora_rank",),
    ("q_lora_rank",),
    ("qk_nope_head_dim",),
    ("qk_rope_head_dim",),
    ("v_head_dim",),
)
# 0 is transformers' own default for these where the feature is off (qwen2_moe: sliding_window 0 with
# use_sliding_window false), and the attention lowering reads 0 as "no window".
_ZERO_MEANS_OFF = frozenset({"sliding_window"})
# Sizes a family may give as a list (per layer: Gemma 3n's intermediate_size; per expert kind: ERNIE 4.5-VL's
# moe_intermediate_size, its text and vision experts).
_PER_LAYER_SIZES = frozenset({"intermediate_size", "moe_intermediate_size"})
_DTYPE_FIELDS = ("dtype", "torch_dtype")
_OBJECT_FIELDS = ("text_config", "quantization_config", "rope_scaling", "rope_parameters")
# Per-layer lists and layer-index lists: transformers iterates them, and a scalar fails as "'bool' object is
# not iterable", naming no field.
_LIST_FIELDS = ("layer_types", "mlp_layer_types", "mlp_only_layers", "no_rope_layers", "moe_layers")
_LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def _find(config: dict, names: tuple[str, ...]) -> tuple[str, object] | None:
    for name in names:
        if config.get(name) is not None:  # null means "not used" (sliding_window, n_inner, head_dim)
            return name, config[name]
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config: dict, cfg_path: Path, tensor_names: list[str] | None = None) -> None:
    """Raise :class:`LlmcError` (exit 2) naming the first field of ``config`` that cannot size an engine.

    ``tensor_names`` (the checkpoint's) lets a wrong layer count name the count the weights hold.
    """
    sections = [("", config)]
    if isinstance(config.get("text_config"), dict):
        sections.append(("text_config.", config["text_config"]))
    for prefix, section in sections:
        _check_section(section, cfg_path, prefix, tensor_names or [])


def check_field_types(config: dict, cfg_path: Path) -> None:
    """Raise :class:`LlmcError` (exit 2) for a field llmc reads before transformers does, or that transformers
    reads without naming it when its type is wrong (``text_config: 3`` fails as "'int' object has no attribute
    'to_dict'"; ``dtype: []`` as an IndexError)."""
    sections = [("", config)]
    if isinstance(config.get("text_config"), dict):
        sections.append(("text_config.", config["text_config"]))
    for prefix, section in sections:
        for name in _OBJECT_FIELDS:
            value = section.get(name)
            if value is not None and not isinstance(value, dict):
                raise LlmcError(f"{cfg_path}: field '{prefix}{name}' is {json.dumps(value)}; it must be an object "
                                "({...}) or null: use the value from the config.json the model came with")
        for name in _LIST_FIELDS:
            value = section.get(name)
            if value is not None and not isinstance(value, list):
                raise LlmcError(f"{cfg_path}: field '{prefix}{name}' is {json.dumps(value)}; it must be an array "
                                "([...], one entry per layer or layer indices) or null: use the value from the "
                                "config.json the model came with")
        for name in _DTYPE_FIELDS:
            value = section.get(name)
            if value is not None and not isinstance(value, str):
                raise LlmcError(f"{cfg_path}: field '{prefix}{name}' is {json.dumps(value)}; it must be a string "
                                "naming the weights' dtype (\"float32\", \"bfloat16\", \"float16\") or null")


def _check_section(config: dict, cfg_path: Path, prefix: str, tensor_names: list[str]) -> None:
    found: dict[str, tuple[str, int]] = {}
    for names in _POSITIVE:
        hit = _find(config, names)
        if hit is None:
            continue
        name, value = hit
        if name in _PER_LAYER_SIZES and isinstance(value, list) and value and all(_is_int(v) and v > 0 for v in value):
            continue  # one size per layer (Gemma 3n's intermediate_size): each entry positive
        if name in ("head_dim", "qk_rope_head_dim") and value == 0 and _is_int(config.get("kv_lora_rank")):
            # latent attention sizes its heads by qk_*_head_dim / v_head_dim, and may have no rotary part: GLM-5
            # Next's defaults (head_dim 0, qk_rope_head_dim 0)
            continue
        least = 0 if name in _ZERO_MEANS_OFF else 1
        if not _is_int(value) or value < least:
            kind = "a non-negative" if least == 0 else "a positive"
            raise LlmcError(f"{cfg_path}: field '{prefix}{name}' is {json.dumps(value)}; it must be {kind} "
                            f"integer{_layer_fix(names[0], tensor_names)}")
        found[names[0]] = (prefix + name, value)

    def field(key: str) -> str:
        name, value = found[key]
        return f"'{name}' ({value})"

    heads, kv = found.get("num_attention_heads"), found.get("num_key_value_heads")
    if heads and kv and heads[1] % kv[1]:
        raise LlmcError(f"{cfg_path}: {field('num_attention_heads')} is not a multiple of "
                        f"{field('num_key_value_heads')}; each key/value head serves a whole group of query heads: "
                        "fix one of them to match the checkpoint")
    hidden = found.get("hidden_size")
    if heads and hidden and "head_dim" not in found and "v_head_dim" not in found and hidden[1] % heads[1]:
        raise LlmcError(f"{cfg_path}: {field('hidden_size')} is not divisible by {field('num_attention_heads')} "
                        "and there is no 'head_dim'; set 'head_dim' or fix the head count to match the checkpoint")
    experts, per_token = found.get("num_local_experts"), found.get("num_experts_per_tok")
    if experts and per_token and per_token[1] > experts[1]:
        raise LlmcError(f"{cfg_path}: {field('num_experts_per_tok')} exceeds {field('num_local_experts')}; a token "
                        "cannot be routed to more experts than the layer has")


def _layer_fix(key: str, tensor_names: list[str]) -> str:
    if key != "num_hidden_layers":
        return ""
    held = {int(m.group(1)) for n in tensor_names if (m := _LAYER_INDEX.search(n))}
    if not held:
        return " (the number of decoder layers)"
    return f" (the number of decoder layers: the checkpoint holds {max(held) + 1}, so set it to {max(held) + 1})"


def check_tokenizer(tokenizer_path: Path, config: dict, cfg_path: Path) -> None:
    """Every id the tokenizer can produce must have a row in the embedding (``vocab_size``): a larger
    tokenizer belongs to another model, and its surplus ids would fail at run time."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        reason = " ".join(str(exc).split())
        raise LlmcError(f"{tokenizer_path}: unreadable ({reason}); use the tokenizer files the model came "
                        "with") from None
    section = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = section.get("vocab_size")
    if not vocab or not _is_int(size):
        return
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    if top >= size:
        raise LlmcError(f"{tokenizer_path}: token {token!r} has id {top} but {cfg_path.name} field 'vocab_size' is "
                        f"{size} (ids 0..{size - 1}); use the tokenizer that came with this checkpoint or fix "
                        "'vocab_size'")
