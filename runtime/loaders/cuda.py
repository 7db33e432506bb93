"""Loading a CUDA engine (manifest ``engine.backend == "cuda"``): its session (or rank 0 of a tensor-parallel
group), a device KV pool sized to the GPU's free memory, and hybrid models' device state slots. The CUDA worker
(and torch) is imported only here, inside :func:`load_cuda`."""

from __future__ import annotations

from pathlib import Path

import llmc.runtime.artifact as artifact
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.state_cache import StatePool
from llmc.runtime.loaders.common import (
    EngineParts,
    LoadOptions,
    eos_ids,
    log_prefix_caching_off,
    max_model_len,
    scheduler_config,
    tokenizer_of,
)


def load_cuda(root: Path, manifest: dict, options: LoadOptions) -> EngineParts:
    """The parts of the CUDA engine at ``root``, on ``options.device`` (default ``"cuda"``)."""
    device = options.device or "cuda"
    problem = artifact.cuda_problem(manifest, device)
    hybrid = manifest.get("state_cache")
    tensor_parallel = int(manifest.get("parallel", {}).get("tensor", 1)) > 1
    if not problem and hybrid and tensor_parallel:
        problem = "a tensor-parallel engine with recurrent layers (state_cache); rebuild it without --tp"
    if problem:
        raise UnsupportedError(f"{root / artifact.MANIFEST}: {problem}")
    if not 0.0 < options.gpu_memory_utilization <= 1.0:
        raise LlmcError(f"gpu_memory_utilization {options.gpu_memory_utilization}: must be in (0, 1]")
    from llmc.runtime.workers.cuda.session import CudaSession

    max_len = max_model_len(root, manifest)
    if tensor_parallel:  # N ranks: this process is rank 0
        from llmc.runtime.workers.cuda.tensor_parallel import TensorParallelSession

        session = TensorParallelSession(root, manifest, device=device, cuda_graphs=options.cuda_graphs,
                                        max_model_len=max_len)
    else:
        session = CudaSession(root, manifest, device=device, cuda_graphs=options.cuda_graphs, max_model_len=max_len)
    config, no_prefix = scheduler_config(options, manifest)
    # Hybrid models: one state slot per running sequence and one for score(), in device memory beside the KV
    # pool (a slot's size does not depend on the sequence's length, so it is reserved whole, before the blocks).
    state_slots = config.max_num_seqs + 1 if hybrid else 0
    state_bytes = StatePool.bytes_per_slot(hybrid) * state_slots if hybrid else 0
    log_prefix_caching_off(root, no_prefix)
    kv = manifest["kv_cache"]
    num_blocks = _num_blocks(root, manifest, session, options, config.max_num_tokens, state_bytes)
    pool = session.allocate_pool(kv, num_blocks)
    state = None
    if hybrid:  # the arrays live on the session's device; the engine's StatePool hands out their slots
        arrays = session.allocate_state(hybrid, state_slots)
        state = StatePool(arrays, list(hybrid["arrays"]), list(range(state_slots - 1, -1, -1)))
    blocks = BlockManager(num_blocks, int(kv["block_size"]), config.enable_prefix_caching)
    return EngineParts(root, manifest, session, pool, blocks, tokenizer_of(root), eos_ids(root), config, state,
                       no_prefix)


def _num_blocks(root: Path, manifest: dict, session, options: LoadOptions, max_num_tokens: int,
                state_bytes: int) -> int:
    """KV blocks: ``kv_cache_tokens``' worth if given, else what fits in ``gpu_memory_utilization`` of the GPU
    after the weights, a step's activations and logits, and the state slots (16384 tokens' worth on the CPU)."""
    kv = manifest["kv_cache"]
    block_size = int(kv["block_size"])
    if options.kv_cache_tokens is not None:
        return max(1, -(-options.kv_cache_tokens // block_size))
    if session.device.type != "cuda":
        return -(-16384 // block_size)
    vocab = int(manifest["engine"]["vocab_size"])
    # room for a step's activations and float32 logits besides the pool and the weights
    reserve = (1 << 30) + max_num_tokens * vocab * 8 + state_bytes
    num_blocks = session.blocks_that_fit(kv, options.gpu_memory_utilization, reserve)
    if num_blocks < 1:
        raise LlmcError(f"{root}: no GPU memory left for the KV cache at gpu_memory_utilization "
                        f"{options.gpu_memory_utilization}; raise it or free the GPU")
    return num_blocks
