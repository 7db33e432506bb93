"""What a build is asked for: :class:`BuildOptions`, their validation, the canonical recipe (the cache key)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmc.errors import LlmcError
from llmc.quant import recipe as quant_recipe
from llmc.quant.recipe import QuantRecipe

ENGINE_KINDS = ("cuda", "tensorrt")
GRAPH_NAME = re.compile(r"[a-z][a-z0-9_]*")
COMPUTE_DTYPE = "float32"
# BuildOptions fields that do not change the artifact, so they stay out of the canonical recipe
# (the cache key). ``disabled_passes`` enters as a sorted set (flag order and repeats do not
# matter; resolving it to the pass list would import the pass modules on every cache hit).
# Any other field, including ones added later, is part of the recipe: a spurious miss is safe,
# a wrong hit is not.
_NOT_IN_RECIPE = frozenset({"force", "extra_passes", "extra_graphs", "self_check", "max_memory"})
# BuildOptions fields that exist only for LoRA engines: left out of the recipe (the cache key) of a build
# without --lora-slots, so that its key is what it was before LoRA existed.
_LORA_FIELDS = ("lora_slots", "max_lora_rank", "lora_targets")


@dataclass
class BuildOptions:
    """What to build. ``block_size`` is the KV-cache block size in tokens."""

    target: str = "cpu"
    block_size: int = 16
    force: bool = False
    disabled_passes: tuple[str, ...] = ()
    verify_passes: bool = False
    # Quantization (llmc.quant): format, algorithm, calibration; the build fails (exit 4) when the
    # quantized engine's held-out perplexity exceeds the unquantized one's by more than this percent.
    quant: QuantRecipe = field(default_factory=QuantRecipe)
    max_ppl_increase: float | None = None
    # GPU targets: which engine ("cuda": llmc's CUDA engine, torch + ahead-of-time Triton kernels;
    # "tensorrt": a TensorRT / TensorRT-for-RTX engine, an export) and the CUDA engine's compute dtype.
    engine: str = "cuda"
    dtype: str = "bfloat16"
    # CUDA engines: compile the Triton kernels ahead of time (off: attention in plain torch, no CUDA graphs;
    # the self-check's twins, which run on the CPU, skip them).
    aot_kernels: bool = True
    # The architecture self-check (compiler/selfcheck.py): a random twin of the config through the same
    # pipeline, against transformers, before the real build. Off only for the twin itself.
    self_check: bool = True
    # GPU targets: the engine's shape limits (None: the defaults of backends.tensorrt.default_profile).
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    # Python API only: passes appended to the pipeline (tests use this to plant a broken pass).
    extra_passes: tuple = ()
    # Python API only: further graphs the artifact carries beside the language model, as (name, path of an ONNX
    # model) pairs, emitted by the backend and sealed in the same manifest (``graphs``); the vision encoder's
    # frontend makes them from a checkpoint. Like extra_passes, builds with them bypass the cache.
    extra_graphs: tuple[tuple[str, str], ...] = ()
    # PagedAttention's route into the kernel: "native" (llmc's custom-op library) or "pyop" (the
    # onnxruntime-extensions Python op, one Python call per layer per step; for debugging/comparison).
    # The CLI takes it from $LLMC_ATTENTION_ROUTE. Part of the recipe, hence of the cache key.
    attention: str = field(default_factory=lambda: os.environ.get("LLMC_ATTENTION_ROUTE", "native"))
    # The most resident memory the build may use, in bytes (``--max-memory``; None: what the machine has). The
    # build refuses up front when its estimate exceeds it, sizes the accuracy report's rounds to it, and stops
    # with exit 5 if it goes past it anyway. It changes no figure, so it is not part of the recipe.
    max_memory: int | None = None
    # Multi-LoRA (passes/lora.py): adapter slots resident at once (0: none, the engine is exactly as without),
    # the largest adapter rank they take, and which linears get them (--lora-targets q,k,v,o,gate,up,down).
    lora_slots: int = 0
    max_lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    # CUDA engines: tensor-parallel ranks (--tp; compiler/sharding.py writes one program and weights file per rank).
    tp: int = 1
    # --ep (with --tp N): MoE experts placed whole on the ranks (expert parallelism) instead of each one split.
    ep: bool = False
    # MXFP4 checkpoints, CPU engine: "float32" (exact: the rows times the codes' values) or "int8" (opt-in, not
    # exact: the rows quantized to 8 bits per 32-block, integer dot products, llama.cpp's MXFP4 x Q8_0 trade).
    mxfp4_activations: str = "float32"
    # Vision-language checkpoints (compiler/multimodal.py): build the text model alone, leaving the encoders out
    # (--text-only; recorded in the manifest). Without it such a checkpoint is refused until its encoders compile.
    text_only: bool = False


@dataclass
class BuildResult:
    """``timings`` are this call's stages in seconds; on a cache hit ``build_info`` still holds the
    original build's timings. ``key`` is None for uncached builds."""

    out_dir: Path
    manifest: dict
    report: dict
    timings: dict[str, float] = field(default_factory=dict)
    build_info: dict = field(default_factory=dict)
    cache_hit: bool = False
    key: str | None = None
    artifact_digest: str | None = None


def validate(options: BuildOptions) -> None:
    """Refuse option values no build takes (exit 2), before any work."""
    if options.block_size < 1 or options.block_size > 1024 or options.block_size & (options.block_size - 1):
        raise LlmcError(f"--block-size {options.block_size}: must be a power of two from 1 to 1024 (default 16)")
    if options.attention not in ("native", "pyop"):
        raise LlmcError(f"attention route {options.attention!r}: must be 'native' (default) or 'pyop'")
    if options.engine not in ENGINE_KINDS:
        raise LlmcError(f"--engine {options.engine}: must be one of {', '.join(ENGINE_KINDS)} (default cuda)")
    if options.dtype not in ("bfloat16", "float16", "float32"):
        raise LlmcError(f"--dtype {options.dtype}: must be bfloat16 (default), float16 or float32")
    if options.tp not in (1, 2, 4, 8):
        raise LlmcError(f"--tp {options.tp}: tensor parallelism takes 1, 2, 4 or 8 ranks (GPUs)")
    if options.ep and options.tp == 1:
        raise LlmcError("--ep places MoE experts on tensor-parallel ranks; give --tp N (2, 4 or 8) with it")
    if options.lora_slots:
        from llmc.passes.lora import check_options

        check_options(options.lora_slots, options.max_lora_rank, tuple(options.lora_targets))
    for name, path in options.extra_graphs:
        if not GRAPH_NAME.fullmatch(name) or name in ("model", "engine"):
            raise LlmcError(f"extra graph {name!r}: a name of lowercase letters, digits and underscores, starting "
                            "with a letter, other than 'model' and 'engine'")
        if not Path(path).is_file():
            raise LlmcError(f"extra graph {name!r}: {path}: no such ONNX file")
    if len({name for name, _ in options.extra_graphs}) != len(options.extra_graphs):
        raise LlmcError("extra graphs: each name once")
    quant_recipe.validate(options.quant)
    if options.max_ppl_increase is not None and (not options.quant.enabled or options.max_ppl_increase < 0):
        raise LlmcError(f"--max-ppl-increase {options.max_ppl_increase:g}: needs a quantized build (--quant or "
                        "--kv-cache-dtype) and a limit of 0 or more percent")


def canonical_recipe(options: BuildOptions) -> dict:
    """The build options that change the artifact, in a canonical form (see ``_NOT_IN_RECIPE``)."""
    recipe = {k: v for k, v in asdict(options).items() if k not in _NOT_IN_RECIPE}
    if not options.lora_slots:
        for k in _LORA_FIELDS:
            del recipe[k]
    if options.tp == 1:  # the keys of single-rank builds stay what they were before --tp existed
        del recipe["tp"]
    if options.mxfp4_activations == "float32":  # the keys of exact builds stay what they were before the option
        del recipe["mxfp4_activations"]
    if not options.text_only:  # the keys of other builds stay what they were before the option
        del recipe["text_only"]
    if not options.ep:
        del recipe["ep"]
    else:
        recipe["lora_targets"] = list(options.lora_targets)
    recipe.update(quant=quant_recipe.canonical(options.quant), compute_dtype=COMPUTE_DTYPE,
                  disabled_passes=sorted(set(options.disabled_passes)))
    return recipe


def recipe_summary(recipe: dict) -> str:
    """One line for `llmc cache ls`: the quantization, block size and what the recipe turned off."""
    parts = [f"quant={quant_recipe.summary(recipe['quant'])}", f"block={recipe['block_size']}"]
    if recipe["disabled_passes"]:
        parts.append("no:" + ",".join(recipe["disabled_passes"]))
    if recipe.get("verify_passes"):
        parts.append("verify-passes")
    return " ".join(parts)
