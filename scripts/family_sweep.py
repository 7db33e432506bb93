"""Sweep every causal-LM (or image-text-to-text) model type of the installed transformers through ``llmc build``.

For each ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:

1. make a tiny random checkpoint from the family's own config class: its defaults, with every size field
   it has made small (``GENERIC``: width 64, 2 layers, 4 heads, vocabulary 512, ...) and a per-family
   table (``FAMILY_OVERRIDES``) where the defaults need more than that; per-layer lists (``layer_types``
   and the like) are cut with the layer count, keeping a layer of each kind;
2. build it with ``llmc build`` in a subprocess, the architecture self-check on;
3. if it builds, generate 32 greedy tokens for 3 prompts (3, 20 and 45 tokens) with the engine and with
   transformers' ``generate``.

Each family ends in one outcome: ``match`` (the engine's tokens equal transformers'), ``mismatch`` (they
differ: a wrong engine the self-check let through), ``refused`` (exit 3, with the one-line reason),
``not decoder-only`` (an encoder-decoder or encoder model under a causal-LM head), ``cannot instantiate
small`` (with why), ``bad input`` (exit 2: llmc rejected the fixture's config), or ``internal error``
(exit 70, a traceback, a crash or a timeout). Every family runs in its own process with a timeout; results
are kept in the JSON file as each family finishes, and a rerun skips the families already there (``--redo``
runs them again).

With ``--mapping image-text-to-text`` the sweep runs every type of transformers'
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` instead (docs/family_sweep_vlm.{md,json}): the vision-language
wrappers. Each gets a tiny random checkpoint of its wrapper class (``AutoModelForImageTextToText``, saved with
``save_pretrained``): its config class's defaults with the text model made small as above, every encoder (vision,
audio, projector, image tokenizer, at any depth) made small too (``ENCODER_SMALL``, and any size field at one of
the wrapper's default widths), special tokens moved inside the small vocabulary, and a per-family table
(``VLM_OVERRIDES``). It is built ``--text-only`` (the text model alone) and compared on text-only prompts (no image,
video or audio placeholder, no special token its config names) with the wrapper's own ``generate``. One more
outcome there: ``needs images`` (transformers' own wrapper cannot run on text alone, yet llmc built it). For the
families whose images llmc places (compiler/vision_encoder.py ``IMAGE_FAMILIES``) the row also says whether the
default build (the vision encoder too) of the same fixture succeeds.

    python scripts/family_sweep.py                           # every type; writes docs/family_sweep.{md,json}
    python scripts/family_sweep.py --families llama,bloom --json /tmp/s.json --md /tmp/s.md
    python scripts/family_sweep.py --mapping image-text-to-text   # writes docs/family_sweep_vlm.{md,json}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python scripts/family_sweep.py"
PROMPT_LENGTHS = (3, 20, 45)
GREEDY_TOKENS = 32
SEED = 0
# A token pair transformers scores closer than the self-check's tolerance (compiler/selfcheck.py, LOGPROB_ATOL) is a
# tie, not a mismatch: either token is greedy within what the build's own check holds the engine to.
TIE_LOGIT_GAP = 2e-3
CAUSAL_LM, IMAGE_TEXT = "causal-lm", "image-text-to-text"  # the mappings swept (--mapping)
MAX_PARAMETERS = 30_000_000  # above this a fixture is not "tiny": the family's defaults need a table entry
VOCAB = 512

# Size fields made small wherever a family's config has them (top level and text_config).
GENERIC = {
    "vocab_size": VOCAB,
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "embed_dim", "n_embed", "d_embed",
                     "model_dim", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"), 2),
    "head_dim": 16,
    "rotary_dim": 8,
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff", "inner_hidden_size",
                     "decoder_ffn_dim", "intermediate_size_mlp", "dense_intermediate_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "shared_intermediate_size", "expert_ffn_hidden_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length"), 256),
    # Multi-head latent attention and grouped routing.
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_group": 2, "topk_group": 1,
}
# Fields whose default must stay within the fixture's experts / layers.
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_top_k", "num_experts_per_token", "moe_k", "top_k_experts")
_WINDOWS = ("sliding_window", "attention_window_size")
# Token ids must index the small vocabulary.
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id", "unk_token_id",
              "decoder_start_token_id", "mask_token_id", "image_token_id", "image_token_index", "video_token_id",
              "audio_token_id", "boi_token_id", "eoi_token_id", "forced_eos_token_id", "forced_bos_token_id")

# Where a family's defaults need more than GENERIC (model_type -> fields, applied last; a dict value is merged into
# the sub-config of that name). Most entries fill fields whose defaults are None or inconsistent at small sizes.
_INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=8)
FAMILY_OVERRIDES: dict[str, dict] = {
    "nemotron": dict(num_key_value_heads=2),  # the default (None) fails in transformers' own attention
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # hybrids: a recurrent layer beside an attention layer (the defaults at 2 layers have only one kind)
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "bamba": dict(attn_layer_indices=[1]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}}),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "kolibri1_1": dict(index_num_heads=2, index_topk=8, index_pool_size=64, index_compression=4,
                       index_num_local_tokens=8, index_num_sink_tokens=2, mlp_only_intermediate_size=128),
    "dots3_note_text": dict(num_key_value_heads=4, head_dim=24, index_n_heads=2, index_head_dim=16, index_topk=8,
                            shared_experts_intermediate_size=32),
    "mamba2": dict(num_heads=8, n_groups=1, time_step_rank=8, state_size=16),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32,
                           indexer_compress_ratio=4, hc_lowrank=16, ple_embed_dim=64, ngram_vocab_size_base=1024,
                           split_ngram_parts=4, heads_per_ngram=2, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16], feed_forward_size=128,
                     attention_head_size=16, attn_layers=["local", "lsh"]),
    "dots1": dict(n_shared_experts=1),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2),
    "gemma3n_text": dict(num_hidden_layers=10, num_kv_shared_layers=5, intermediate_size=[128] * 10,
                         layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
                         activation_sparsity_pattern=[0.95] * 2 + [0.0] * 8, laurel_rank=8),
    "gemma4_text": dict(vocab_size_per_layer_input=512, hidden_size_per_layer_input=16),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB),
}
FAMILY_OVERRIDES["qwen4_exp"] = {"text_config": FAMILY_OVERRIDES["qwen4_exp_text"]}
FAMILY_OVERRIDES["dots3_note"] = {"text_config": FAMILY_OVERRIDES["dots3_note_text"]}
FAMILY_OVERRIDES["gemma3n"] = {"text_config": FAMILY_OVERRIDES["gemma3n_text"]}
FAMILY_OVERRIDES["gemma4"] = {"text_config": FAMILY_OVERRIDES["gemma4_text"]}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _small(section: dict) -> dict:
    """Overrides for one config section (a ``to_dict()``): GENERIC's fields it has, and its token ids."""
    # A size left None means "derived" (or, for some families, "off"): set it only where it is derived, head_dim.
    out = {k: v for k, v in GENERIC.items() if k in section and not isinstance(section[k], (dict, list))
           and (section[k] is not None or k == "head_dim")}
    heads = next((k for k in ("num_attention_heads", "n_head", "num_heads", "n_heads") if k in out), None)
    for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads"):
        if heads and k in out and section[k] == section[heads]:
            out[k] = out[heads]  # multi-head attention stays multi-head (some families require it)
    experts = next((out[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                    if k in out), None)
    if experts is None:  # a family whose experts default to None (dense unless set): give it some
        for k in ("n_routed_experts", "num_experts"):
            if k in section and section[k] is None and any(section.get(t) is None for t in _TOP_K if t in section):
                out[k] = experts = 4
    for k in _TOP_K:
        if k in section and experts is not None and (section[k] is None or isinstance(section[k], int)
                                                     and section[k] > experts):
            out[k] = 2
    for k in _WINDOWS:
        if isinstance(section.get(k), int):
            out[k] = 16
    for k in _TOKEN_IDS:
        v = section.get(k)
        if isinstance(v, int) and v >= VOCAB:
            out[k] = 2 if "eos" in k else 1 if "bos" in k else 0 if "pad" in k else min(v, VOCAB - 1) % 64 + 3
        elif isinstance(v, list) and any(isinstance(i, int) and i >= VOCAB for i in v):
            out[k] = [2]
    if section.get("head_dim") is not None and section.get("head_dim") == section.get("qk_rope_head_dim"):
        out["head_dim"] = GENERIC["qk_rope_head_dim"]  # DeepSeek's head_dim is its rotary part
    if "is_decoder" in section:  # encoder families under a causal-LM head are causal only as decoders (their
        out["is_decoder"] = True  # causal-LM classes warn without it); no cross-attention is added
    for k in ("vocab_size_per_layer_input", "emb_dim"):
        if isinstance(section.get(k), int):
            out[k] = VOCAB if k.startswith("vocab") else 64
    if "hidden_size_per_layer_input" in section and isinstance(section["hidden_size_per_layer_input"], int) \
            and section["hidden_size_per_layer_input"]:
        out["hidden_size_per_layer_input"] = 16
    _cut_lists(section, out)
    # A nested config (text, vision, audio, encoder, patcher, ...): the same, recursively.
    for k, v in section.items():
        if isinstance(v, dict) and k not in ("rope_parameters", "rope_scaling", "id2label", "label2id",
                                             "quantization_config", "per_layer_config") \
                and any(g in v for g in GENERIC):
            out[k] = {**v, **_small(v)}
    return out


def _cut_lists(section: dict, out: dict) -> None:
    """Cut per-layer lists (one entry per default layer) to the fixture's layer count, keeping a layer of each
    kind (the count grows to the first layer of the last kind, as the self-check's twin does); a list of sizes
    (``intermediate_size`` per layer) gets the small size; ``per_layer_config`` keeps the layers that remain."""
    from llmc.compiler.selfcheck import _per_layer_lists, cut_layers

    lkey = next((k for k in _LAYER_KEYS if isinstance(section.get(k), int)), None)
    if lkey is None:
        return
    layers = section[lkey]
    lists = _per_layer_lists(section, layers)
    keep = out.get(lkey, layers)
    for key in lists:
        values = section[key]
        if key not in GENERIC and all(isinstance(v, (str, bool, int)) for v in values) \
                and len(set(map(str, values))) <= 4:
            seen: set = set()
            for i, v in enumerate(values):
                if str(v) not in seen:
                    seen.add(str(v))
                    keep = max(keep, i + 1)
    keep = min(keep, layers)
    cut = cut_layers(section, lkey, keep)
    out[lkey] = keep
    for key in lists + ["mlp_only_layers", "moe_layers"]:
        if key in section and cut.get(key) != section.get(key):
            out[key] = [GENERIC[key]] * keep if key in GENERIC else cut[key]
    plc = section.get("per_layer_config")
    if isinstance(plc, dict):
        out["per_layer_config"] = {k: {**v, **{f: g for f, g in _small(v).items() if f in v}}
                                   for k, v in plc.items() if str(k).isdigit() and int(k) < keep}


# Knob variants (``--variants``; rows named ``FAMILY+KNOB``): the same family with a config knob the released
# checkpoints set differently from the config class's defaults, so that a twin or lowering that ignores it shows.
VARIANTS = ("head_dim", "untied", "tied", "bias")


def _apply_variant(knob: str, defaults: dict, overrides: dict) -> dict:
    """``overrides`` with ``knob`` turned on; raises CannotInstantiate where the family has no such knob."""
    merged = {**defaults, **overrides}
    if knob == "head_dim":  # explicit, = width / heads (Helium-2B: 20 x 128 = 2560), as released configs write it
        heads, width = merged.get("num_attention_heads"), merged.get("hidden_size")
        if not (isinstance(heads, int) and isinstance(width, int)) or "head_dim" not in defaults:
            raise CannotInstantiate("its config has no head_dim knob")
        return {**overrides, "head_dim": width // heads}
    if knob in ("untied", "tied"):
        if "tie_word_embeddings" not in defaults:
            raise CannotInstantiate("its config has no tie_word_embeddings knob")
        return {**overrides, "tie_word_embeddings": knob == "tied"}
    if knob == "bias":
        keys = [k for k in ("attention_bias", "mlp_bias", "bias", "use_bias") if k in defaults]
        if not keys:
            raise CannotInstantiate("its config has no bias knob")
        return {**overrides, **dict.fromkeys(keys, True)}
    raise ValueError(f"unknown variant {knob!r}: choose from {', '.join(VARIANTS)}")


def tiny_config(model_type: str):
    """The family's config class at its defaults with every size field small (GENERIC, then FAMILY_OVERRIDES), and
    a variant's knob for ``FAMILY+KNOB``."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family, _, knob = model_type.partition("+")
    defaults = CONFIG_MAPPING[family]().to_dict()
    overrides = _small(defaults)
    for k, v in FAMILY_OVERRIDES.get(family, {}).items():
        overrides[k] = {**overrides[k], **v} if isinstance(v, dict) and isinstance(overrides.get(k), dict) else v
    if knob:
        overrides = _apply_variant(knob, defaults, overrides)
    return AutoConfig.for_model(family, **overrides)


# Image-text-to-text wrappers (``--mapping image-text-to-text``): their encoders' size fields beyond GENERIC's, in
# every nested config but the text model's (a vision tower's depth, its output width, which must be the text model's).
ENCODER_SMALL = {"depth": 2, "encoder_layers": 2, "num_layers": 2, "layers": 2, "width": 64, "heads": 4,
                 "embed_dim": 64, "num_heads": 4, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
                 # projectors' and decoders' inner widths, image tokenizers' (VQ-GAN) channels and codebooks
                 **dict.fromkeys(("projector_hidden_size", "alignment_intermediate_size", "projection_hidden_dim",
                                  "projection_intermediate_size", "mlp_dim", "decoder_intermediate_size"), 128),
                 "decoder_hidden_size": 64, "decoder_num_layers": 2, "base_channels": 32, "latent_channels": 32,
                 "num_res_blocks": 1, "codebook_size": 64, "num_embeddings": 64, "output_channels": 32}
_ENCODER_WIDTHS = ("out_hidden_size", "text_hidden_size", "projection_dim", "output_dim", "vision_output_dim",
                   "projector_output_dim", "out_dim")
# A wrapper's special-token fields (image, video, audio placeholders; start/end of image; ...), all of which must lie
# inside the small vocabulary and apart from each other and from the prompts' tokens.
_SPECIAL_FIELD = re.compile(r"(^|_)(token_id|token_index|token_ids|token_indices|id|index)$")
# A size field that repeats a default width under another name (an adapter's input, a projector's output).
_WIDTH_FIELD = re.compile(r"(dim|size|hidden|width)")
_NOT_WIDTH = re.compile(r"(vocab|patch|image|kernel|merge|window|pool|chunk|position|resolution|bucket|max|num_|"
                        r"feature_size|temporal|spatial|token|layer)")
# Which of a wrapper's nested configs is its text model.
_TEXT_KEYS = ("text_config", "llm_config", "language_config", "text_model_config")
_NOT_CONFIGS = ("rope_parameters", "rope_scaling", "id2label", "label2id", "quantization_config", "per_layer_config")

# Where a wrapper's defaults need more than that (model_type -> fields, merged into the small config at any depth).
_IMAGE_VOCABULARY = {"<image>": VOCAB - 1, **{f"IMGIMG{chr(65 + i)}Z": 400 + i for i in range(8)},
                     **{f"<|visual token {i:06d}|>": 400 + i for i in range(8)}, "<|extra_200|>": VOCAB - 2}
VLM_OVERRIDES: dict[str, dict] = {
    "apertus1p5": dict(image_token_offset=256, audio_token_offset=320, vision_config=dict(codebook_size=64),
                       audio_config=dict(codebook_size=64)),
    # the image tokens' vocabulary their models read when built (None in their defaults)
    **dict.fromkeys(("chameleon", "emu3"), dict(vocabulary_map=_IMAGE_VOCABULARY)),
    # M-RoPE sections the modeling code defaults to when the config names none (Qwen2-VL's [16, 24, 24] for 128-wide
    # heads, GLM-4V's [8, 12, 12]), at the small heads' size
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "paddleocr_vl", "glm4v", "glm46v", "glm_ocr",
                     "glmga"), dict(text_config=dict(rope_parameters=dict(mrope_section=[2, 3, 3])))),
    "glm4v_moe": dict(text_config=dict(rope_parameters=dict(mrope_section=[1, 2, 1]))),  # half the head rotates
    "hy_v4_vl": dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                       "mrope_section": [2, 1, 1]})),
    "ernie4_5_vl_moe": dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                              "mrope_section": [3, 3, 2]},
                                             moe_intermediate_size=[32, 16])),  # its text experts', vision experts'
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"], num_experts_per_tok=2)),
    "diffusion_gemma": dict(text_config=dict(moe_intermediate_size=32)),
    "glm5_next": dict(text_config=dict(qk_rope_head_dim=0)),
    # its defaults name no M-RoPE sections, without which its text model cannot run: HunYuan's four axes
    "hunyuan_vl": dict(text_config=dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                         "mrope_section": [2, 2, 2, 2]})),
    "step3p7": dict(text_config=dict(sliding_window=16)),  # its text model makes a sliding mask whatever its layers
    "granite4_vision": dict(downsample_rate="1/2", deepstack_layer_map=[[1, 0], [0, 1]], spatial_target_layers=[1]),
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[-1, -2])),
    **dict.fromkeys(("inkling2", "inkling2_loop"), dict(text_config=dict(unpadded_vocab_size=VOCAB))),
    "gemma4_unified": dict(vision_config=dict(mm_embed_dim=64, output_proj_dims=64)),
    "mistral4": dict(qk_nope_head_dim=8),  # head_dim = nope + rope part, as its defaults have it
    "muse_glimmer": dict(out_hidden_size=256),  # the tower's width merged 2 x 2
    "muse_spark": dict(out_hidden_size=256, audio_config=dict(hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1])),
    "florence2": dict(vision_config=dict(embed_dim=[16, 32, 32, 64], num_heads=[1, 2, 2, 4], num_groups=[1, 2, 2, 4],
                                         depths=[1, 1, 1, 1])),
}


def _deep_merge(base: dict, extra: dict) -> dict:
    return {**base, **{k: _deep_merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict)
                       and k != "vocabulary_map" else v for k, v in extra.items()}}


def _small_encoders(defaults: dict, small: dict, widths: set, width: int) -> None:
    """Make ``small`` (the overrides of one config section, ``defaults``) small in its encoder sizes, and each nested
    config but the text model's, at any depth: ENCODER_SMALL's fields, the output widths the text model's, and any
    size field at one of the wrapper's default widths the small width."""
    small.update({k: 64 for k, v in defaults.items() if isinstance(k, str) and type(v) is int and v in widths
                  and small.get(k, v) == v and _WIDTH_FIELD.search(k) and not _NOT_WIDTH.search(k)})
    small.update({k: v for k, v in ENCODER_SMALL.items() if k.startswith(("projector", "alignment"))
                  and type(defaults.get(k)) is int})
    for name, section in defaults.items():
        if not isinstance(section, dict) or name in _TEXT_KEYS or name in _NOT_CONFIGS:
            continue
        sub = small[name] if isinstance(small.get(name), dict) else {**section, **_small(section)}
        sub.update({k: v for k, v in ENCODER_SMALL.items() if type(section.get(k)) is int})
        sub.update({k: width for k in _ENCODER_WIDTHS if type(section.get(k)) is int})
        _small_encoders(section, sub, widths, width)
        if sub != section:
            small[name] = sub


def _head_dim(section: dict) -> int | None:
    heads, width = section.get("num_attention_heads"), section.get("hidden_size")
    return section.get("head_dim") or (width // heads if heads and width else None)


def _scale_mrope(defaults: dict, small: dict) -> None:
    """M-RoPE sections (Qwen2-VL's ``mrope_section``: time, height, width) scaled with the head size, their sum kept
    at the same share of it (each section at least 1)."""
    rope = {**(defaults.get("rope_parameters") or {}), **(small.get("rope_parameters") or {})}
    old, new = _head_dim(defaults), _head_dim({**defaults, **small})
    sections = rope.get("mrope_section")
    if not (isinstance(sections, list) and sections and all(isinstance(x, int) for x in sections) and old and new) \
            or old == new:
        return
    total = max(len(sections), round(sum(sections) * new / old))
    exact = [x * total / sum(sections) for x in sections]
    cut = [max(1, int(x)) for x in exact]
    for i in sorted(range(len(cut)), key=lambda i: cut[i] - exact[i]):  # the largest remainders first
        if sum(cut) >= total:
            break
        cut[i] += 1
    small["rope_parameters"] = {**rope, "mrope_section": cut}


def _widths(section: dict) -> set:
    """Every ``hidden_size`` of a config and its nested configs (the default widths)."""
    found = {section.get("hidden_size")} - {None}
    for k, v in section.items():
        if isinstance(v, dict) and k not in _NOT_CONFIGS:
            found |= _widths(v)
    return found


def _special_ids(section: dict, defaults: dict, assigned: dict, free: list[int]) -> dict:
    """The changes that move each special-token id of ``section`` (and of its nested configs) whose default (in
    ``defaults``) lies outside the small vocabulary to a free id at the vocabulary's top, the same default id to the
    same new one, distinct ids apart (bos 1, eos 2, pad 0 as GENERIC's); a nested config's change is the whole nested
    dict."""
    changes: dict = {}
    for k, v in section.items():
        default = defaults.get(k, v)
        if isinstance(v, dict) and k not in ("id2label", "label2id"):
            sub = _special_ids(v, default if isinstance(default, dict) else v, assigned, free)
            if sub:
                changes[k] = {**v, **sub}
            continue
        if not isinstance(k, str) or not _SPECIAL_FIELD.search(k) or isinstance(v, bool):
            continue
        fixed = 2 if "eos" in k else 1 if "bos" in k else 0 if "pad" in k else None

        def new(i, fixed=fixed):
            if not isinstance(i, int) or i < VOCAB:
                return i
            if fixed is not None:
                return fixed
            if i not in assigned:
                assigned[i] = free.pop()
            return assigned[i]
        if isinstance(default, int) and default >= VOCAB:
            changes[k] = new(default)
        elif isinstance(default, list) and any(isinstance(i, int) and i >= VOCAB for i in default):
            changes[k] = [new(i) for i in default]
    return changes


def tiny_vlm_config(model_type: str):
    """An image-text-to-text wrapper's config class at its defaults (its vision tower's where they leave it out),
    small: its text model as :func:`tiny_config` makes one (GENERIC, and FAMILY_OVERRIDES of the text model's type),
    its encoders (vision, audio, projectors, ...) at any depth with GENERIC's and ENCODER_SMALL's sizes and their
    output width the text model's, its special tokens inside the small vocabulary and apart; then FAMILY_OVERRIDES
    and VLM_OVERRIDES of the wrapper's type."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    vision_class = (getattr(config_class, "sub_configs", None) or {}).get("vision_config")
    filled = defaults.get("vision_config", {}) is None and isinstance(vision_class, type) \
        and vision_class.__name__ != "AutoConfig"  # a wrapper whose defaults leave out its vision tower (Gemma 4)
    if filled:
        defaults["vision_config"] = vision_class().to_dict()
    overrides = _small(defaults)
    if filled:
        overrides.setdefault("vision_config", dict(defaults["vision_config"]))
    text_key = next((k for k in _TEXT_KEYS if isinstance(defaults.get(k), dict)), None)
    if text_key:
        text = overrides.setdefault(text_key, dict(defaults[text_key]))
        for k, v in FAMILY_OVERRIDES.get(text.get("model_type"), {}).items():
            text[k] = {**text[k], **v} if isinstance(v, dict) and isinstance(text.get(k), dict) else v
        _scale_mrope(defaults[text_key], text)
    width = overrides[text_key].get("hidden_size", 64) if text_key else overrides.get("hidden_size", 64)
    _small_encoders(defaults, overrides, _widths(defaults), width)
    overrides.update(_special_ids({**defaults, **overrides}, defaults, {}, list(range(VOCAB - 64, VOCAB))))
    for k, v in FAMILY_OVERRIDES.get(model_type, {}).items():
        overrides[k] = {**overrides[k], **v} if isinstance(v, dict) and isinstance(overrides.get(k), dict) else v
    return AutoConfig.for_model(model_type, **_deep_merge(overrides, VLM_OVERRIDES.get(model_type, {})))


def _auto_class(mapping: str):
    """transformers' auto class of a mapping's models: a causal LM, or an image-text-to-text wrapper as itself."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if mapping == IMAGE_TEXT else AutoModelForCausalLM


def _encoder_decoder(config) -> bool:
    return any(getattr(c, "is_encoder_decoder", False) for c in (config, getattr(config, "text_config", None)))


def write_fixture(model_type: str, out: Path, mapping: str = CAUSAL_LM) -> dict:
    """Write the tiny random checkpoint of ``model_type`` (float32, no tokenizer: engines take token ids) under the
    mapping's class (a wrapper of ``image-text-to-text`` with its encoders, all small); return facts about it. Raises
    :class:`CannotInstantiate` when the family cannot be made tiny."""
    import torch
    from transformers import GenerationConfig

    auto = _auto_class(mapping)
    try:
        config = tiny_vlm_config(model_type) if mapping == IMAGE_TEXT else tiny_config(model_type)
    except Exception as exc:  # noqa: BLE001 - the family's config class refuses the small sizes
        if mapping == IMAGE_TEXT and getattr(_default_config(model_type), "is_encoder_decoder", False):
            raise NotDecoderOnly(f"an encoder-decoder wrapper whose config refuses small sizes: {_one_line(exc)}") \
                from None
        raise CannotInstantiate(f"its config class refuses small sizes: {_one_line(exc)}") from None
    with torch.device("meta"):
        try:
            meta = auto.from_config(config)
        except Exception as exc:  # noqa: BLE001
            if _encoder_decoder(config):
                kind = "image-text-to-text" if mapping == IMAGE_TEXT else "causal-LM"
                raise NotDecoderOnly(f"an encoder-decoder config ({type(config).__name__}) whose {kind} class "
                                     f"cannot be built from it alone: {_one_line(exc)}") from None
            raise CannotInstantiate(f"its model class cannot be built from the small config: {_one_line(exc)}") \
                from None
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_PARAMETERS:
        big = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
        raise CannotInstantiate(f"{n / 1e6:.0f}M parameters with every known size field small (largest: {big[0]} "
                                f"{tuple(big[1].shape)}); it needs an entry in FAMILY_OVERRIDES")
    del meta
    torch.manual_seed(SEED)
    try:
        model = auto.from_config(config, dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - sizes the meta device does not check (negative widths)
        raise CannotInstantiate(f"its model class cannot be built from the small config: {_one_line(exc)}") from None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if any(s in name for s in ("embed", "wte", "wpe", "lm_head")) else 0.15)
            elif bool((p == 1).all()):  # a norm's scale: around 1, not exactly 1, so a wrong norm shows
                p.uniform_(0.8, 1.2)
            elif bool((p == 0).all()):  # a bias, or a (1 + w) norm's w: around 0, not exactly 0
                p.uniform_(-0.2, 0.2) if "norm" in name or "ln" in name else p.normal_(0.0, 0.05)
    text_error = None
    try:  # transformers itself must run the fixture, or a failure would be blamed on llmc
        with torch.no_grad():
            if mapping == IMAGE_TEXT:  # by name: a wrapper's first argument may be its pixels
                model(input_ids=torch.tensor([prompt_ids(config.to_dict(), VOCAB)[:8]]))
            else:
                model(torch.arange(4, 12)[None])
    except Exception as exc:  # noqa: BLE001
        if mapping != IMAGE_TEXT:
            raise CannotInstantiate(f"transformers' own forward fails on the small config: {_one_line(exc)}") \
                from None
        # A wrapper whose own forward needs more than text (pixels, a Q-Former's ids, bounding boxes): saved anyway,
        # so that the sweep records how llmc answers a text-only build of it (a one-line refusal is right).
        text_error = _one_line(exc)
    model.generation_config = GenerationConfig(do_sample=False)
    try:
        model.save_pretrained(out)
    except Exception as exc:  # noqa: BLE001 - transformers' own conversion on save (Inkling 2's padded vocabulary)
        raise CannotInstantiate(f"transformers cannot save the small model: {_one_line(exc)}") from None
    text_config = getattr(config, "text_config", None) if mapping == IMAGE_TEXT else None
    facts = {"model_class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
             **({"text_model_type": getattr(text_config, "model_type", None)} if text_config is not None else {}),
             "encoder_decoder": _encoder_decoder(config) if mapping == IMAGE_TEXT
             else bool(getattr(config, "is_encoder_decoder", False))}
    return {**facts, "text_forward_error": text_error} if text_error else facts


def _default_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001
        return None


def special_token_ids(config: dict) -> set[int]:
    """Every special-token id a (wrapper's) config names, at any depth: its image, video and audio placeholders,
    start/end tokens, image-token vocabulary (``vocabulary_map``), bos/eos/pad."""
    found: set[int] = set()
    for k, v in config.items():
        if k == "vocabulary_map" and isinstance(v, dict):
            found |= {i for i in v.values() if isinstance(i, int)}
        elif isinstance(v, dict) and k not in ("id2label", "label2id"):
            found |= special_token_ids(v)
        elif isinstance(k, str) and _SPECIAL_FIELD.search(k) and not isinstance(v, bool):
            found |= {i for i in (v if isinstance(v, list) else [v]) if isinstance(i, int)}
    return found


def prompt_ids(config: dict, vocab: int) -> list[int]:
    """The ids a text-only prompt of a wrapper draws from: 4 and above, none of its special tokens."""
    avoid = special_token_ids(config)
    return [i for i in range(4, min(vocab, VOCAB)) if i not in avoid]


class CannotInstantiate(Exception):
    pass


class NotDecoderOnly(Exception):
    pass


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _llmc_build(ckpt: Path, engine: Path, cache: Path, *flags: str, self_check: bool = True) -> tuple[int, str]:
    """``llmc build CKPT -o ENGINE -q [FLAGS]`` with the self-check on (a test may turn it off): its exit code and
    stderr. The command runs in
    this (the family's own) process, through the CLI's entry point, which saves a second start of torch and
    transformers per family; an exception that escapes the CLI is an internal error, with its traceback."""
    import traceback

    from click.testing import CliRunner

    from llmc.cli.main import cli

    result = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(engine), "-q", *flags],
                                env={"LLMC_SELF_CHECK": "1" if self_check else "0", "LLMC_CACHE_DIR": str(cache)})
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
        return 70, stderr
    return result.exit_code, stderr


def _positions_from_ids(hf) -> bool:
    """RoBERTa-style embeddings: without ``position_ids`` (the model as defined, after fairseq) token n reads
    position row ``padding_idx + 1 + n``; transformers' ``generate`` passes them 0-based ids (its generic default), so
    its tokens are not the model's. The reference for these is the model's own forward."""
    return any(callable(getattr(m, "create_position_ids_from_input_ids", None)) for m in hf.modules())


def _greedy_reference(hf, prompt: list[int], n: int, by_name: bool = False) -> list[int]:
    """transformers' greedy continuation of ``prompt``: ``generate``, else its forward token by token (``by_name``:
    the ids passed as ``input_ids=``, for a wrapper whose first argument is its pixels)."""
    import torch

    with torch.no_grad():
        if not _positions_from_ids(hf):
            try:
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                return out[0, len(prompt):].tolist()
            except Exception:  # noqa: BLE001 - a family whose generate() needs more: the plain forward, no cache
                pass
        ids = list(prompt)
        for _ in range(n):
            ids.append(int((hf(input_ids=torch.tensor([ids])) if by_name else hf(torch.tensor([ids])))
                           .logits[0, -1].argmax()))
        return ids[len(prompt):]


def run_one(model_type: str, work: Path, mapping: str = CAUSAL_LM, *, self_check: bool = True,
            image_build: bool = True) -> dict:
    """One family, start to end: its outcome and the evidence. A wrapper of ``image-text-to-text`` is built
    ``--text-only`` and its text prompts compared with the wrapper's own ``generate`` (then, for IMAGE_FAMILIES,
    built with its images too, unless ``image_build`` is off). ``self_check`` off: a test's quicker build."""
    import numpy as np

    t0 = time.perf_counter()
    row: dict = {"model_type": model_type}
    ckpt = work / "checkpoint"
    vlm = mapping == IMAGE_TEXT
    try:
        row.update(write_fixture(model_type, ckpt, mapping))
    except CannotInstantiate as exc:
        row.update(outcome="cannot instantiate small", reason=str(exc))
        return row
    except NotDecoderOnly as exc:
        row.update(outcome="not decoder-only", reason=str(exc))
        return row
    engine = work / "engine"
    code, stderr = _llmc_build(ckpt, engine, work / "cache", *(["--text-only"] if vlm else []),
                               self_check=self_check)
    if vlm and code == 2 and "leave --text-only out" in stderr:
        # llmc sees no encoder to leave out (Fuyu's image path is a projection inside the wrapper): as it says
        row["text_only_exit_2"] = stderr.strip().splitlines()[-1].replace(str(ckpt), "<checkpoint>")
        code, stderr = _llmc_build(ckpt, engine, work / "cache", self_check=self_check)
    row["build_seconds"] = round(time.perf_counter() - t0, 1)
    row["exit_code"] = code
    lines = stderr.strip().splitlines()
    last = (lines or [""])[-1].replace(str(ckpt), "<checkpoint>").replace(str(work), "<work>")
    if "Traceback" in stderr or code not in (0, 2, 3, 4, 5):
        row.update(outcome="internal error", reason=last[:500])
        if "Traceback" in stderr:
            row["traceback_tail"] = stderr[-2000:]
        return row
    if code == 3:
        # (every refusal of a vision-language wrapper names its encoders: there the config says which it is)
        decoder_only = not row["encoder_decoder"] or not vlm and "encoder" not in last
        row.update(outcome="refused" if decoder_only else "not decoder-only", reason=last.removeprefix("error: "))
        return row
    if code != 0:
        row.update(outcome="bad input" if code == 2 else f"exit {code}",
                   reason=last.removeprefix("error: "))
        return row
    if row.get("text_forward_error"):
        row.update(outcome="needs images", reason="transformers' own wrapper cannot run on text alone "
                   f"({row['text_forward_error']}), yet llmc built it --text-only: no reference to compare with")
        return row

    import torch

    from llmc.runtime import Engine, SamplingParams

    eng = Engine.load(engine)
    hf = _auto_class(mapping).from_pretrained(ckpt, dtype=torch.float32).eval()
    rng = np.random.default_rng(SEED)
    if vlm:  # text only: no image, video or audio placeholder, no start/end-of-image token
        allowed = prompt_ids(json.loads((ckpt / "config.json").read_text()), eng.vocab_size)
        prompts = [rng.choice(allowed, n).tolist() for n in PROMPT_LENGTHS]
    else:
        prompts = [rng.integers(4, min(eng.vocab_size, VOCAB), n).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    got = [eng.generate([p], params)[0].token_ids for p in prompts]
    want = [_greedy_reference(hf, p, GREEDY_TOKENS, by_name=vlm) for p in prompts]
    row["tokens_compared"] = sum(map(len, want))
    differs, ties = {}, []
    for p, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b)
        # Random weights make near-ties: where transformers itself scores both tokens alike, either is greedy.
        with torch.no_grad():
            ids = torch.tensor([p + w[:i]])
            logits = (hf(input_ids=ids) if vlm else hf(ids)).logits[0, -1].double()
        gap = float(logits[w[i]] - logits[g[i]])
        if gap <= TIE_LOGIT_GAP:
            ties.append(f"token {i} after the {len(p)}-token prompt, logit gap {gap:.1e}")
        else:
            differs[len(p)] = (i, gap)
    if differs:
        row.update(outcome="mismatch", reason="first differing token: " + ", ".join(
            f"{i} after the {n}-token prompt (transformers' logit gap {gap:.2g})" for n, (i, gap) in differs.items()))
    else:
        tied = f"; a near-tie where transformers' top two tokens differ by <= {TIE_LOGIT_GAP}: {', '.join(ties)}"
        row.update(outcome="match", reason=_fusions(engine) + (tied if ties else ""))
    if vlm and image_build:
        row["image_build"] = _image_build(model_type, ckpt, work)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _image_build(model_type: str, ckpt: Path, work: Path) -> str | None:
    """For a family whose images llmc places (compiler/vision_encoder.py IMAGE_FAMILIES): whether the default build
    (the vision encoder too, the self-check on) of the same fixture succeeds, in one line; None for other families.
    The fixture has no tokenizer: families whose image layout names tokenizer tokens are refused for want of it."""
    from llmc.compiler.vision_encoder import IMAGE_FAMILIES

    if model_type not in IMAGE_FAMILIES:
        return None
    t0 = time.perf_counter()
    code, stderr = _llmc_build(ckpt, work / "engine-images", work / "cache")
    took = f" ({time.perf_counter() - t0:.0f} s)"
    if code == 0:
        graphs = json.loads((work / "engine-images" / "manifest.json").read_text()).get("graphs", {})
        return f"built, with {', '.join(sorted(graphs)) or 'no further graph'}" + took
    last = (stderr.strip().splitlines() or [""])[-1].replace(str(ckpt), "<checkpoint>").removeprefix("error: ")
    kind = "refused" if code == 3 and "Traceback" not in stderr else f"exit {code}"
    return f"{kind}: {re.sub(r'^<checkpoint>(/config.json)?: ', '', last)[:300]}" + took


def _fusions(engine: Path) -> str:
    """The fusion passes that fired in the build (report.json), as the match's note."""
    from llmc.passes.registry import BY_NAME

    report = json.loads((engine / "report.json").read_text())
    fired = [f"{p['pass']} x{p['matches']}" for p in report.get("passes", [])
             if p.get("matches") and p["pass"] in BY_NAME and BY_NAME[p["pass"]].fusion]
    fired += [f"{k} x{v}" for k, v in report.get("backend_fusions", {}).items() if v]
    return "fusions: " + (", ".join(fired) or "none")


# Common families first, so that a partial run says the most.
POPULAR = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "mixtral",
           "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "gpt2", "gpt_neox", "falcon", "olmo2", "olmo",
           "cohere", "cohere2", "starcoder2", "granite", "gpt_oss", "llama4_text", "glm4", "glm", "stablelm",
           "smollm3", "exaone4", "internlm3", "ministral", "ministral3", "seed_oss", "hunyuan_v1_dense",
           "hunyuan_v1_moe", "ernie4_5", "ernie4_5_moe", "minimax_m2", "glm4_moe", "olmoe", "phimoe", "dbrx",
           "jetmoe", "granitemoe", "bloom", "mpt", "opt", "gptj", "gpt_neo", "codegen", "gpt_bigcode", "persimmon",
           "nemotron", "helium", "apertus", "arcee", "cohere2_moe", "diffllama", "bitnet", "qwen3_5_text",
           "qwen3_next", "gemma4_text", "mamba", "rwkv", "jamba")


def sweep_order(mapping: str = CAUSAL_LM) -> list[str]:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if mapping == IMAGE_TEXT:
        from llmc.compiler.vision_encoder import IMAGE_FAMILIES

        every = list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
        return [t for t in IMAGE_FAMILIES if t in every] + sorted(t for t in every if t not in IMAGE_FAMILIES)
    every = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return [t for t in POPULAR if t in every] + sorted(t for t in every if t not in POPULAR)


def run_isolated(model_type: str, timeout: float, keep: Path | None = None, mapping: str = CAUSAL_LM) -> dict:
    """``run_one`` in a child process of its own (a session, so a timeout kills its whole tree), in a scratch
    directory; a crash or a timeout is an outcome, never the end of the sweep."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"llmc-sweep-{model_type}-") as tmp:
        work = keep / model_type if keep is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, __file__, "--one", model_type, "--work", str(work),
                                 "--mapping", mapping],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                cwd=REPO_ROOT)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: its build and self-check worker too
            proc.communicate()
            return {"model_type": model_type, "outcome": "timeout",
                    "reason": f"no outcome within {timeout:.0f} s (fixture, build and comparison)",
                    "seconds": round(time.perf_counter() - t0, 1)}
    rows = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and rows:
        return json.loads(rows[-1])
    tail = (err.strip().splitlines() or ["(no output)"])[-1]
    return {"model_type": model_type, "outcome": "internal error",
            "reason": f"the sweep's worker failed (exit {proc.returncode}): {tail[:400]}",
            "traceback_tail": err[-2000:], "seconds": round(time.perf_counter() - t0, 1)}


OUTCOMES = ("match", "refused", "not decoder-only", "cannot instantiate small", "bad input", "mismatch",
            "internal error", "timeout")
VLM_OUTCOMES = (*OUTCOMES[:4], "needs images", *OUTCOMES[4:])


def render_markdown(data: dict) -> str:
    if data["meta"].get("mapping") == IMAGE_TEXT:
        return render_vlm_markdown(data)
    meta, rows = data["meta"], data["rows"]
    counts = {o: sum(r["outcome"] == o for r in rows.values()) for o in OUTCOMES}
    counts.update({r["outcome"]: counts.get(r["outcome"], 0) for r in rows.values() if r["outcome"] not in counts})
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    lines = [
        "# Family sweep: every causal-LM model type of transformers through `llmc build`",
        "",
        f"<!-- Generated by `{COMMAND}`; do not edit by hand. -->",
        f"Generated by `{COMMAND}` (writes this file and `docs/family_sweep.json`); do not edit it by hand. "
        f"Run: {meta.get('run_at', meta['updated_at'])}{_rerun_summary(meta)} with llmc {meta['llmc']}, transformers "
        f"{meta['transformers']}, torch {meta['torch']}, target `cpu`. The image-text-to-text types (vision-language "
        f"wrappers, built `--text-only`) are in [family_sweep_vlm.md](family_sweep_vlm.md).",
        "",
        f"**{len(rows)} of {meta['types_total']} model types** in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` "
        f"run: {summary}.",
        "",
        "Each family gets a tiny random float32 checkpoint of its own config class (defaults, with every size "
        "field small and a per-family table where that is not enough: `scripts/family_sweep.py`), built by "
        f"`llmc build` with the architecture self-check on. A build that succeeds generates {GREEDY_TOKENS} greedy "
        f"tokens after each of {len(PROMPT_LENGTHS)} prompts ({', '.join(map(str, PROMPT_LENGTHS))} tokens); "
        "**match** means they equal transformers' `generate` (for RoBERTa-style embeddings, to which `generate` "
        "passes 0-based position ids unlike their own forward, the forward token by token). **refused**: "
        "`llmc build` stopped with exit 3 and the reason shown. **cannot instantiate small**: the family's classes "
        "cannot be made tiny here (why shown). "
        "**internal error**: exit 70, a traceback, or no outcome within the timeout. The random fixtures exercise "
        "the default configuration of each family only; options a family's real checkpoints set differently can "
        "still be refused (or caught by the self-check) when they are built.",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        *[f"Rerun {r['at']} ({len(r['families'])} rows: {', '.join(r['families'])}): {r['why']}" + "\n"
          for r in meta.get("reruns", [])],
        "| model_type | outcome | reason / mechanism |",
        "|---|---|---|",
    ]
    for t in sorted(rows):
        r = rows[t]
        reason = re.sub(r"^<checkpoint>(/config\.json)?: ", "", str(r.get("reason", ""))).replace("|", "\\|")
        lines.append(f"| {t} | {r['outcome']} | {reason} |")
    lines.append("")
    return "\n".join(lines)


VLM_COMMAND = f"{COMMAND} --mapping {IMAGE_TEXT}"


def render_vlm_markdown(data: dict) -> str:
    """The image-text-to-text table (docs/family_sweep_vlm.md)."""
    meta, rows = data["meta"], data["rows"]
    counts = {o: sum(r["outcome"] == o for r in rows.values()) for o in VLM_OUTCOMES}
    counts.update({r["outcome"]: counts.get(r["outcome"], 0) for r in rows.values() if r["outcome"] not in counts})
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    images = {t: r["image_build"] for t, r in rows.items() if r.get("image_build")}
    lines = [
        "# Family sweep: every image-text-to-text model type of transformers through `llmc build --text-only`",
        "",
        f"<!-- Generated by `{VLM_COMMAND}`; do not edit by hand. -->",
        f"Generated by `{VLM_COMMAND}` (writes this file and `docs/family_sweep_vlm.json`); do not edit it by hand. "
        f"Run: {meta.get('run_at', meta['updated_at'])}{_rerun_summary(meta)} with llmc {meta['llmc']}, transformers "
        f"{meta['transformers']}, torch {meta['torch']}, target `cpu`. The causal-LM types are in "
        "[family_sweep.md](family_sweep.md).",
        "",
        f"**{len(rows)} of {meta['types_total']} model types** in transformers' "
        f"`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` run: {summary}.",
        "",
        "Each type gets a tiny random float32 checkpoint of its wrapper (its own config class at its defaults, the "
        "text model made small as in the causal-LM sweep, every encoder — vision, audio, projector, image tokenizer "
        "— made small too, its special tokens inside the small vocabulary; a per-family table where that is not "
        "enough: `scripts/family_sweep.py` `VLM_OVERRIDES`), saved with `save_pretrained` under "
        "`AutoModelForImageTextToText`, and built by `llmc build --text-only` with the architecture self-check on. "
        f"A build that succeeds generates {GREEDY_TOKENS} greedy tokens after each of {len(PROMPT_LENGTHS)} "
        f"text-only prompts ({', '.join(map(str, PROMPT_LENGTHS))} tokens, none of them an image, video or audio "
        "placeholder or any other special token the config names); **match** means they equal the wrapper's own "
        "`generate` in transformers. **refused**: `llmc build` stopped with exit 3 and the reason shown. **not "
        "decoder-only**: an encoder-decoder wrapper. **cannot instantiate small**: the wrapper cannot be made tiny "
        "here (why shown). **needs images**: transformers' own wrapper cannot run on text alone, yet llmc built it. "
        "**internal error**: exit 70, a traceback, or no outcome within the timeout. *image build*: for the families "
        "whose images llmc places (`compiler/vision_encoder.py` `IMAGE_FAMILIES`), whether the default build of the "
        "same fixture (the vision encoder compiled too) succeeds; the fixtures have no tokenizer, which families "
        "whose image layout names tokenizer tokens need.",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        *[f"Rerun {r['at']} ({len(r['families'])} rows: {', '.join(r['families'])}): {r['why']}" + "\n"
          for r in meta.get("reruns", [])],
        "| model_type | text model | outcome | reason / mechanism |" + (" image build |" if images else ""),
        "|---|---|---|---|" + ("---|" if images else ""),
    ]
    for t in sorted(rows):
        r = rows[t]
        reason = re.sub(r"^<checkpoint>(/config\.json)?: ", "", str(r.get("reason", ""))).replace("|", "\\|")
        if r.get("text_only_exit_2"):
            reason = f"built without --text-only, which llmc refused (exit 2: no encoder to leave out): {reason}"
        image = " " + str(images.get(t, "")).replace("|", "\\|") + " |" if images else ""
        lines.append(f"| {t} | {r.get('text_model_type') or ''} | {r['outcome']} | {reason} |{image}")
    lines.append("")
    return "\n".join(lines)


def _rerun_summary(meta: dict) -> str:
    reruns = meta.get("reruns") or []
    if not reruns:
        return ""
    return f" ({sum(len(r['families']) for r in reruns)} rows rerun since, the last at {reruns[-1]['at']}: see below)"


def merge(part_path: Path, json_path: Path, md_path: Path, why: str) -> None:
    """Put the rows of a partial run (``--families ... --json PART``) into the committed table, recording when they
    were rerun and why. The table is re-read just before it is written: another run may have merged rows meanwhile."""
    part = json.loads(part_path.read_text())
    data = json.loads(json_path.read_text())
    data["rows"].update(part["rows"])
    meta = data["meta"]
    meta.setdefault("run_at", meta["updated_at"])
    meta.setdefault("reruns", []).append({"at": part["meta"]["updated_at"], "families": sorted(part["rows"]),
                                          "why": why})
    _save(data, json_path, md_path)


def _save(data: dict, json_path: Path, md_path: Path) -> None:
    import llmc

    data["meta"].update(updated_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), llmc=llmc.__version__,
                        **{pkg: version(pkg) for pkg in ("torch", "transformers", "onnxruntime")})
    texts = ((json_path, json.dumps(data, indent=1, sort_keys=True) + "\n"), (md_path, render_markdown(data)))
    for path, text in texts:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(path.suffix + ".tmp")
        part.write_text(text)
        part.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mapping", choices=(CAUSAL_LM, IMAGE_TEXT), default=CAUSAL_LM,
                        help=f"which transformers mapping to sweep: {CAUSAL_LM} (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "
                             f"the default; docs/family_sweep.*) or {IMAGE_TEXT} (MODEL_FOR_IMAGE_TEXT_TO_TEXT_"
                             "MAPPING_NAMES: each wrapper built --text-only, compared with its own generate on text; "
                             "docs/family_sweep_vlm.*)")
    parser.add_argument("--families", help="comma-separated model types (default: every type of the mapping)")
    parser.add_argument("--variants", help=f"comma-separated knobs ({', '.join(VARIANTS)}): each family also built "
                                           "with each knob turned on, as rows FAMILY+KNOB")
    parser.add_argument("--json", type=Path, help="the results (default: docs/family_sweep.json, or "
                                                   "docs/family_sweep_vlm.json with --mapping image-text-to-text)")
    parser.add_argument("--md", type=Path, help="the table (default: docs/family_sweep.md or family_sweep_vlm.md)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family (default 300)")
    parser.add_argument("--redo", action="store_true", help="run families already in the JSON file again")
    parser.add_argument("--redo-outcomes", help="comma-separated outcomes to run again (e.g. 'internal error')")
    parser.add_argument("--jobs", type=int, default=1, help="families run at the same time (each in its process)")
    parser.add_argument("--keep", type=Path, help="keep each family's checkpoint and engine under this folder")
    parser.add_argument("--note", help="a sentence about this run, kept in the JSON's meta and shown in the table")
    parser.add_argument("--merge", type=Path, metavar="PART_JSON",
                        help="merge a partial run's rows into --json/--md instead of running (with --why)")
    parser.add_argument("--why", help="with --merge: why those rows were rerun, shown in the table")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    vlm = args.mapping == IMAGE_TEXT
    stem = "family_sweep_vlm" if vlm else "family_sweep"
    args.json = args.json or REPO_ROOT / "docs" / f"{stem}.json"
    args.md = args.md or REPO_ROOT / "docs" / f"{stem}.md"
    if args.one:  # the worker: one family, its row as the last line of stdout
        import logging
        import warnings

        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        print(json.dumps(run_one(args.one, args.work, args.mapping)), flush=True)
        return 0
    if args.merge:
        if not args.why:
            parser.error("--merge needs --why (the reason those rows were rerun, shown in the table)")
        merge(args.merge, args.json, args.md, args.why)
        return 0

    every = sweep_order(args.mapping)
    families = args.families.split(",") if args.families else every
    if args.variants and vlm:
        parser.error("--variants: causal-LM types only")
    if args.variants:
        knobs = args.variants.split(",")
        bad_knobs = [k for k in knobs if k not in VARIANTS]
        if bad_knobs:
            parser.error(f"--variants: {', '.join(bad_knobs)}: choose from {', '.join(VARIANTS)}")
        families = [f"{f}+{k}" if k else f for f in families for k in ("", *knobs)]
    unknown = [f for f in families if f.partition("+")[0] not in every]
    if unknown:
        name = "IMAGE_TEXT_TO_TEXT" if vlm else "CAUSAL_LM"
        parser.error(f"--families: {', '.join(unknown)} not in MODEL_FOR_{name}_MAPPING_NAMES")
    data = json.loads(args.json.read_text()) if args.json.is_file() else {"meta": {}, "rows": {}}
    data["meta"].update(command=VLM_COMMAND if vlm else COMMAND, types_total=len(every), timeout_s=args.timeout)
    if vlm:
        data["meta"]["mapping"] = IMAGE_TEXT
    if args.note:
        data["meta"]["note"] = args.note
    redo = set(args.redo_outcomes.split(",")) if args.redo_outcomes else set()
    todo = [f for f in families if f not in data["rows"] or args.redo or data["rows"][f]["outcome"] in redo]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # threads wait; the work is in processes
        running = {pool.submit(run_isolated, f, args.timeout, args.keep, args.mapping): f for f in todo}
        for done in as_completed(running):
            family, row = running[done], done.result()
            row.setdefault("seconds", row.get("build_seconds"))
            data["rows"][family] = row
            _save(data, args.json, args.md)
            print(f"{family}: {row['outcome']} ({row.get('seconds')} s) {str(row.get('reason', ''))[:160]}",
                  file=sys.stderr, flush=True)
    bad = [t for t, r in data["rows"].items() if r["outcome"] in ("internal error", "timeout", "mismatch")]
    print(f"{len(data['rows'])} of {len(every)} types in {args.json}"
          + (f"; needing work: {', '.join(bad)}" if bad else ""), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
