"""Loading an ONNX Runtime CPU engine: its session, a host KV pool, the block manager and, for hybrid models, a
state pool held to the KV pool's size."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import llmc.runtime.artifact as artifact
from llmc.errors import LlmcError
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.kv_cache import KVPool
from llmc.runtime.core.scheduler import SchedulerConfig
from llmc.runtime.core.state_cache import StatePool
from llmc.runtime.loaders.common import (
    STATE_MIN_BYTES,
    EngineParts,
    LoadOptions,
    eos_ids,
    log_prefix_caching_off,
    scheduler_config,
    tokenizer_of,
)
from llmc.runtime.workers.ort.session import OrtSession, custom_ops_of

DEFAULT_KV_CACHE_TOKENS = 16384


def load_ort(root: Path, manifest: dict, options: LoadOptions) -> EngineParts:
    """The parts of the CPU engine at ``root`` (manifest ``engine.backend == "onnxruntime"``)."""
    engine_info, kv = manifest["engine"], manifest["kv_cache"]
    if options.device not in (None, "cpu"):
        raise LlmcError(f"{root / artifact.MANIFEST}: device {options.device!r}: this is a CPU engine (backend "
                        f"{engine_info.get('backend')!r}); build with --gpu to run on a GPU")
    kv_cache_tokens = DEFAULT_KV_CACHE_TOKENS if options.kv_cache_tokens is None else options.kv_cache_tokens
    if engine_info.get("backend") != "onnxruntime":
        raise LlmcError(
            f"{root / artifact.MANIFEST}: engine backend {engine_info.get('backend')!r} cannot run on this "
            "machine (this runtime runs 'onnxruntime' CPU engines); build with --target cpu"
        )
    config, no_prefix = scheduler_config(options, manifest)
    log_prefix_caching_off(root, no_prefix)
    session = OrtSession(root / engine_info["model_file"], num_threads=options.num_threads or os.cpu_count(),
                         custom_ops=custom_ops_of(manifest))
    if options.attention_threads is not None:
        session.set_attention_threads(int(options.attention_threads))
    block_size = int(kv["block_size"])
    num_blocks = max(1, -(-kv_cache_tokens // block_size))
    pool = KVPool.allocate(kv["num_layers"], num_blocks, kv["num_kv_heads"], block_size, kv["head_size"],
                           kv["dtype"], kv.get("layers"))
    tokenizer = tokenizer_of(root)
    blocks = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    state = _state_pool(root, manifest, config, num_blocks, options.state_cache_bytes)
    return EngineParts(root, manifest, session, pool, blocks, tokenizer, eos_ids(root), config, state, no_prefix)


def _state_pool(root: Path, manifest: dict, config: SchedulerConfig, num_blocks: int,
                state_cache_bytes: int | None) -> StatePool | None:
    """A hybrid model's state slots: one per running sequence, and one for score(); at most as much state as the
    KV pool holds (and at least STATE_MIN_BYTES' worth), fewer running sequences (``config.max_num_seqs``,
    lowered here) if need be. None without recurrent layers."""
    hybrid = manifest.get("state_cache")
    if not hybrid:
        return None
    kv = manifest["kv_cache"]
    max_num_seqs = config.max_num_seqs
    per_slot = StatePool.bytes_per_slot(hybrid)
    budget = state_cache_bytes
    if budget is None:
        budget = max(STATE_MIN_BYTES, KVPool.bytes_per_block(
            kv["num_layers"], kv["num_kv_heads"], int(kv["block_size"]), kv["head_size"], kv["dtype"],
            kv.get("layers")) * num_blocks)
    slots = min(max_num_seqs + 1, max(2, budget // per_slot))
    if slots < max_num_seqs + 1:
        logging.getLogger("llmc").warning(
            "%s: max_num_seqs %d -> %d: each sequence's recurrent state takes %.1f MB, and the state pool is "
            "held to the KV pool's size (raise kv_cache_tokens to run more sequences at once)", root,
            max_num_seqs, slots - 1, per_slot / 1e6)
        config.max_num_seqs = slots - 1
    return StatePool.allocate(hybrid, slots)
