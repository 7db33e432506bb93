"""Attention mechanisms llmc does not lower yet, recognised from config.json before any work.

The self-check (compiler/selfcheck.py) would stop such a build too, after tracing a twin; naming the
mechanism up front is cheaper and says why. Each rule reads only config.json (a text model nested under
``text_config`` as well), so a build-cache hit applies it too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmc.errors import UnsupportedError


def _alibi(c: dict, model_type: str) -> str | None:
    attn = c.get("attn_config") if isinstance(c.get("attn_config"), dict) else {}
    if model_type == "bloom" or c.get("alibi") is True or attn.get("alibi") is True \
            or c.get("position_embedding_type") == "alibi":
        return ("ALiBi position bias (a per-head linear bias on attention scores instead of rotary); llmc's paged "
                "attention has no score bias")
    return None


def _sinks(c: dict, model_type: str) -> str | None:
    if model_type == "gpt_oss":
        return ("attention sinks (a learned per-head logit in every softmax denominator); llmc's paged attention "
                "has no sink term")
    return None


def _chunked(c: dict, model_type: str) -> str | None:
    if c.get("attention_chunk_size") is not None:
        return (f"chunked local attention (attention_chunk_size {c['attention_chunk_size']}: tokens see only their "
                "own chunk) and complex-valued rotary; llmc lowers full and sliding-window attention only")
    return None


RULES: tuple[Callable[[dict, str], str | None], ...] = (_alibi, _sinks, _chunked)


def refuse_unlowered(config: dict, model_type: str, cfg_path: Path) -> None:
    """Raise :class:`UnsupportedError` (exit 3) naming the first mechanism of ``config`` llmc cannot lower."""
    sections = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    for section in sections:
        for rule in RULES:
            why = rule(section, section.get("model_type") or model_type)
            if why:
                raise UnsupportedError(f"{cfg_path}: model_type {model_type!r} uses {why}, so llmc cannot build "
                                       "it correctly yet and stops before any work")
