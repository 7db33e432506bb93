"""Attention mechanisms llmc does not lower yet, recognised from config.json before any work.

The self-check (compiler/selfcheck.py) would stop such a build too, after tracing a twin; naming the
mechanism up front is cheaper and says why. Each rule reads only config.json (a text model nested under
``text_config`` as well), so a build-cache hit applies it too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmc.errors import UnsupportedError

# Families whose ALiBi llmc lowers (compiler/alibi_attention.py replaces their inline attention).
ALIBI_LOWERED = frozenset({"bloom", "mpt"})


def _alibi(c: dict, model_type: str) -> str | None:
    if model_type in ALIBI_LOWERED:
        return None
    attn = c.get("attn_config") if isinstance(c.get("attn_config"), dict) else {}
    if c.get("alibi") is True or attn.get("alibi") is True or c.get("position_embedding_type") == "alibi":
        return ("ALiBi position bias in an attention module llmc does not replace (llmc lowers bloom's and mpt's "
                "ALiBi attention)")
    return None


def _chunked(c: dict, model_type: str) -> str | None:
    if c.get("attention_chunk_size") is not None and model_type != "llama4_text":  # compiler/llama4_text.py
        return (f"chunked local attention (attention_chunk_size {c['attention_chunk_size']}: tokens see only their "
                "own chunk) outside llama4_text, whose attention llmc replaces (compiler/llama4_text.py)")
    return None


RULES: tuple[Callable[[dict, str], str | None], ...] = (_alibi, _chunked)


def refuse_unlowered(config: dict, model_type: str, cfg_path: Path) -> None:
    """Raise :class:`UnsupportedError` (exit 3) naming the first mechanism of ``config`` llmc cannot lower."""
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    for section in sections:
        for rule in RULES:
            why = rule(section, section.get("model_type") or model_type)
            if why:
                raise UnsupportedError(f"{cfg_path}: model_type {model_type!r} uses {why}, so llmc cannot build "
                                       "it correctly yet and stops before any work")


# Mechanisms named when a build cannot trace a family or its self-check catches it, from config fields (set to a
# value that turns them on) and from the model's module class names. They are not refused up front: a field can
# be present and off, and the generic path may lower a family that uses one; these only say what failed.
def _on(value) -> bool:
    return value not in (None, False, 0, 0.0, "", [], {})


_FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("vision_config", "audio_config", "vq_config", "audio_encoder_config", "vision_tower_config"),
     "multimodal models (an image or audio encoder beside the text model; llmc builds text-only causal LMs)"),
    (("lambda_std_dev", "lambda_init"), "differential attention (two softmax attention maps subtracted, weighted "
                                        "by a learned lambda)"),
    (("index_topk", "index_n_heads", "indexer_n_heads", "index_topk_blocks", "indexer_types", "indexer_budget"),
     "sparse attention chosen by a learned indexer (DeepSeek sparse attention: each query attends to its top-k "
     "keys only)"),
    (("per_layer_config",), "per-layer attention geometry (per_layer_config: layers with different head counts or "
                            "head sizes)"),
    (("hidden_size_per_layer_input", "vocab_size_per_layer_input"), "per-layer input embeddings"),
    (("num_kv_shared_layers", "kv_source_layers"), "KV-shared layers (layers that attend over another layer's keys "
                                                   "and values)"),
    (("altup_num_inputs",), "AltUp (several hidden-state streams, one updated per layer)"),
    (("laurel_rank",), "LAuReL low-rank residual branches"),
    (("hc_count", "hc_mult"), "hyper-connections (several residual streams mixed in every layer)"),
    (("n_recurrent_loops",), "looped layers (a block of layers run several times)"),
    (("cross_attention_layers",), "cross-attention layers"),
    (("compress_rates",), "compressed attention"),
    (("ngram_size",), "n-gram embeddings"),
    (("mem_len",), "segment-level recurrent memory"),
    (("position_bias_num_buckets", "relative_attention_num_buckets", "relative_max_distance"),
     "relative position buckets (a learned bias on attention scores)"),
    (("encoder_hash_byte_group_vocab", "patcher_config"), "byte patching with local encoder and decoder models"),
    (("cca_time0", "cca_time1"), "compressed convolutional attention (queries and keys convolved over tokens, values "
                                 "mixed with the previous token's, state kept beside the KV cache)"),
    (("keep_window_size",), "dynamic mask attention (a bias on the attention scores computed from the values, "
                            "passed as the attention mask)"),
)
# (substring of a module class name, mechanism), lower case.
_CLASSES: tuple[tuple[str, str], ...] = (
    ("diffattention", _FIELDS[1][1]), ("diffllamaattention", _FIELDS[1][1]),
    ("indexer", _FIELDS[2][1]),
    ("altup", _FIELDS[6][1]), ("laurel", _FIELDS[7][1]),
    ("hyperconnection", _FIELDS[8][1]),
    ("crossattention", _FIELDS[10][1]),
    ("lshselfattention", "locality-sensitive-hashing (LSH) attention"),
    ("localselfattention", "chunked local self-attention"),
    ("blocksparse", "block-sparse attention"), ("bigbirdblocksparse", "block-sparse attention"),
    ("relpartiallearnable", "relative position attention with memory"),
    ("mamba", "state-space (Mamba) layers"), ("linearattention", "linear attention"),
    ("gateddeltanet", "gated delta-rule linear attention"), ("shortconv", "short convolutions over tokens"),
    ("ccaprojection", _FIELDS[16][1]), ("dogeattention", _FIELDS[17][1]),
)


# (substring of the tracer's error, mechanism), lower case: what the exporter names when it meets an op it cannot
# translate.
_ERRORS: tuple[tuple[str, str], ...] = (
    ("llmc_paged", "attention that bypasses transformers' AttentionInterface (the family picks its attention class "
                   "from a table of its own, so llmc's paged attention cannot be swapped in)"),
    ("complex", "complex-valued tensors (e.g. rotary embeddings applied through torch.view_as_complex), which ONNX "
                "has no type for"),
)


def _sections(config: dict) -> list[dict]:
    out = [config]
    for key in ("text_config", "attn_config"):
        if isinstance(config.get(key), dict):
            out.append(config[key])
    return out


def name_mechanism(config: dict, module_classes=(), error: str = "") -> str | None:
    """The mechanism llmc does not lower that ``config`` (a config.json dict) turns on, that one of
    ``module_classes`` (class names of the modules involved, innermost first) implements, or that the tracer's
    ``error`` names; None if none is known."""
    low_error = error.lower()
    for pattern, what in _ERRORS:
        if pattern in low_error:
            return what
    if "no attribute 'vocab_size'" in low_error and isinstance(config.get("text_config"), dict):
        return _FIELDS[0][1]  # a composite config (text model under text_config beside other sub-models)
    for name in module_classes:
        low = name.lower()
        for pattern, what in _CLASSES:
            if pattern in low:
                return what
    for section in _sections(config):
        for fields, what in _FIELDS:
            if any(_on(section.get(f)) for f in fields):
                return what
        if section.get("use_bidirectional_attention") is True:
            return "bidirectional attention (tokens attend to later tokens)"
        if section.get("add_cross_attention") is True:
            return _FIELDS[10][1]
        if isinstance(section.get("attn_layers"), list) and "lsh" in section["attn_layers"]:
            return "locality-sensitive-hashing (LSH) attention"
        if section.get("attention_type") == "block_sparse":
            return "block-sparse attention"
        if section.get("position_embedding_type") in ("relative_key", "relative_key_query"):
            return "relative position embeddings inside attention"
    return None
