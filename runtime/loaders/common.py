"""What the loaders share: the options of ``Engine.load`` that shape the parts, the parts an engine is made of,
and what an artifact says about its model (context length, end-of-sequence tokens)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.scheduler import SchedulerConfig
from llmc.runtime.core.state_cache import NO_PREFIX_CACHING, StatePool
from llmc.runtime.tokenizer import Tokenizer

# A hybrid engine's state pool may take at least this much memory, whatever the KV pool's size.
STATE_MIN_BYTES = 256 << 20


@dataclass
class LoadOptions:
    """``Engine.load``'s options that shape the loaded parts (see ``Engine.load`` for each one's meaning)."""

    kv_cache_tokens: int | None = None
    max_num_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting: int = 1024
    enable_chunked_prefill: bool = True
    max_prefill_tokens_with_decodes: int | None = None
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    attention_threads: int | None = 0
    verify: bool = True
    device: str | None = None
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    state_cache_bytes: int | None = None


@dataclass
class EngineParts:
    """A loaded engine's parts, the arguments of ``Engine(...)``: its executor (``session``: a worker with
    ``run(feeds, pool)``), KV pool and block manager, tokenizer (None without tokenizer.json), scheduler limits,
    hybrid models' state slots (None without recurrent layers), and why prefix caching is off ("" if it is not)."""

    path: Path
    manifest: dict
    session: Any
    pool: Any
    blocks: BlockManager
    tokenizer: Tokenizer | None
    eos_ids: list[int]
    config: SchedulerConfig
    state: StatePool | None = None
    prefix_caching_disabled_reason: str = ""


def scheduler_config(options: LoadOptions, manifest: dict) -> tuple[SchedulerConfig, str]:
    """The scheduler's limits, and why prefix caching is off although asked for ("" when it is not): engines with
    length-dependent rotary factors (``rope_recompute_at``) and hybrid models run without it."""
    rope_at = manifest["engine"].get("rope_recompute_at")
    prefix = options.enable_prefix_caching and rope_at is None
    reason = ""
    if manifest.get("state_cache") and prefix:
        reason, prefix = NO_PREFIX_CACHING, False
    config = SchedulerConfig(max_num_tokens=options.max_num_tokens, max_num_seqs=options.max_num_seqs,
                             max_waiting=options.max_waiting, enable_chunked_prefill=options.enable_chunked_prefill,
                             max_prefill_tokens_with_decodes=options.max_prefill_tokens_with_decodes,
                             enable_prefix_caching=prefix, rope_recompute_at=rope_at)
    return config, reason


def log_prefix_caching_off(root: Path, reason: str) -> None:
    if reason:
        logging.getLogger("llmc").info("%s: prefix caching is off: %s", root, reason)


def tokenizer_of(root: Path) -> Tokenizer | None:
    return Tokenizer(root) if (root / "tokenizer.json").is_file() else None


def max_model_len(root: Path, manifest: dict) -> int | None:
    """The longest sequence (prompt + output tokens) the model supports: its max_position_embeddings."""
    n = manifest.get("engine", {}).get("max_position_embeddings")
    if not n and (root / "hf_config.json").is_file():
        n = json.loads((root / "hf_config.json").read_text()).get("max_position_embeddings")
    return int(n) if n else None


def eos_ids(root: Path) -> list[int]:
    """The model's end-of-sequence token ids (generation_config.json, else hf_config.json; [] if neither)."""
    for name in ("generation_config.json", "hf_config.json"):
        f = root / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
