"""``llmc build``: checkpoint → traced graph → passes → backend → sealed artifact.

:func:`build` always compiles. :func:`build_cached` (what the CLI runs) first looks the build up
in the content-addressed store (:mod:`llmc.build_cache`) and compiles only on a miss.

Output directories are written into a temporary sibling directory and renamed into place only
when complete, so a failed or interrupted build never leaves a partial output directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import llmc
from llmc.build_cache import KeyInputs, Store, sources_digest
from llmc.compiler import artifact
from llmc.compiler.checkpoint import Checkpoint, load_checkpoint
from llmc.compiler.targets import GPU_BACKENDS, TARGETS, Target, get_target
from llmc.errors import EXIT_OUT_OF_MEMORY, LlmcError, UnsupportedError
from llmc.plugins.paged_attention import KV_LAYOUT
from llmc.quant import recipe as quant_recipe
from llmc.quant.recipe import QuantRecipe
from llmc.runtime import artifact as runtime_artifact

# The tracing, pass and backend modules import torch / onnx / onnx_ir (seconds of start-up), so
# they are imported only when something is compiled: a cache hit never needs them.

Progress = Callable[[str], None]
ENGINE_KINDS = ("cuda", "tensorrt")

COMPUTE_DTYPE = "float32"
# BuildOptions fields that do not change the artifact, so they stay out of the canonical recipe
# (the cache key). ``disabled_passes`` enters as a sorted set (flag order and repeats do not
# matter; resolving it to the pass list would import the pass modules on every cache hit).
# Any other field, including ones added later, is part of the recipe: a spurious miss is safe,
# a wrong hit is not.
_NOT_IN_RECIPE = frozenset({"force", "extra_passes", "self_check", "max_memory"})
_PACKAGE_ROOT = Path(llmc.__file__).resolve().parent


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


# BuildOptions fields that exist only for LoRA engines: left out of the recipe (the cache key) of a build
# without --lora-slots, so that its key is what it was before LoRA existed.
_LORA_FIELDS = ("lora_slots", "max_lora_rank", "lora_targets")


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


@dataclass
class _Plan:
    out: Path
    options: BuildOptions
    target: Target
    # Where GPU builders keep their timing caches (the build cache's root; see build_cached).
    cache_root: Path | None = None
    # The build's memory estimate (compiler.memory_plan.Estimate) and, under --max-memory, the accuracy report's
    # round size in tokens.
    memory: object | None = None
    round_tokens: int | None = None


def _plan_memory(ckpt: Checkpoint, plan: _Plan) -> None:
    """Refuse, before any work, a build whose estimate exceeds --max-memory (exit 5); size its rounds to it."""
    from llmc.compiler import memory_plan

    plan.memory, plan.round_tokens = memory_plan.check(plan.options.max_memory, ckpt.tensors, ckpt.config,
                                                       plan.options.quant)


def _check_hybrid(ckpt: Checkpoint, plan: _Plan) -> None:
    """What a hybrid model (layers with recurrent state: llmc.compiler.checkpoint.HYBRID_MODEL_TYPES) cannot be
    built with yet, refused before any work (exit 3), naming the missing piece."""
    from llmc.compiler.checkpoint import HYBRID_MODEL_TYPES

    layers = HYBRID_MODEL_TYPES.get(ckpt.model_type)
    if layers is None:
        return
    options, target = plan.options, plan.target
    head = f"{ckpt.path}: model_type {ckpt.model_type!r} has {layers}, which keep recurrent state between tokens"
    if not uses_cuda_engine(options, target) and (target.sm is not None or target.backend != "onnxruntime"):
        raise UnsupportedError(f"{head}; {target.flag} --engine {options.engine}: only llmc's CUDA engine and the CPU "
                               "engine have kernels for them; build with --engine cuda (the default) or --target cpu")
    if options.tp > 1:
        raise UnsupportedError(f"{head}; --tp {options.tp}: their state pool and ops are not split across ranks yet; "
                               "build without --tp")
    if target.sm is not None and options.quant.enabled:
        raise UnsupportedError(f"{head}; {target.flag} --quant: quantized CUDA engines of such models are not built "
                               "yet; build the GPU engine without --quant (or quantize for --target cpu)")
    if options.verify_passes:
        raise UnsupportedError(f"{head}; --verify-passes runs graphs without their state pool; build without it")
    if options.attention != "native":
        raise UnsupportedError(f"{head}; their ops run only in llmc's native custom-op library; build with the "
                               "native attention route")


def _check_tp(ckpt: Checkpoint, plan: _Plan) -> None:
    """--tp N: what the sharding pass (compiler/sharding.py) cannot split, refused before any work (exit 3)."""
    from llmc.compiler import sharding

    options = plan.options
    if options.tp > 1:
        fmt = options.quant.format
        group = options.quant.group_size if fmt is not None and fmt.family == "int4" else None
        sharding.check_config(ckpt.config, options.tp, str(ckpt.path / "config.json"), group, ep=options.ep)


def _carry_int4(ckpt: Checkpoint, plan: _Plan) -> None:
    """A checkpoint that arrives in INT4 (compiler/prequantized_int4.py: AutoAWQ GEMM, GPTQ) keeps its weights: the
    build's recipe becomes INT4 with the checkpoint's group size and zero points, the embeddings and LM head stay as
    stored, and the INT4 stage takes the checkpoint's codes instead of quantizing (never dequantize and re-quantize).
    A request that would re-quantize them, or a target without this path yet, is refused before any work (exit 3)."""
    import dataclasses

    from llmc.compiler import prequantized_int4

    if not prequantized_int4.carried(ckpt.tensors):
        return
    options, target = plan.options, plan.target
    q = options.quant
    group = ckpt.source_quantization["group_size"]
    method = ckpt.source_quantization["method"].upper()
    head = f"{ckpt.path}: the checkpoint is already INT4 ({method}, group {group}, with zero points)"
    if q.quant not in ("none", "int4", "int4-awq", "int4-gptq"):
        raise UnsupportedError(f"{head}; --quant {q.quant} would dequantize and re-quantize it; build with "
                               "--quant int4 (or leave --quant out) to keep its weights, or build from the unquantized "
                               "original")
    if q.symmetric:
        raise UnsupportedError(f"{head}; --symmetric would drop its zero points; leave --symmetric out")
    if target.sm is not None and not uses_cuda_engine(options, target):
        raise UnsupportedError(f"{head}; {target.flag} --engine tensorrt: TensorRT's INT4 GEMMs take symmetric groups, "
                               "which would re-quantize it; build the CUDA engine (leave --engine out) or --target cpu")
    if target.sm is not None and options.dtype == "bfloat16":
        # The CUDA engine keeps INT4 group scales in its compute dtype: float16 scales are exact in float16/float32.
        raise UnsupportedError(f"{head}; {target.flag} --dtype bfloat16 would round its float16 scales to bfloat16; "
                               "build with --dtype float16 (or float32)")
    recipe = dataclasses.replace(q, quant="int4", group_size=group, symmetric=False, embeddings="none", lm_head="none")
    quant_recipe.check_target(recipe, target.name, TARGETS)
    plan.options = dataclasses.replace(options, quant=recipe)
    if uses_cuda_engine(plan.options, target):
        plan.options = _check_cuda_request(plan.options, target)


def _carry_mxfp4(ckpt: Checkpoint, plan: _Plan) -> None:
    """A gpt-oss checkpoint with MXFP4 experts (compiler/prequantized_mxfp4.py) keeps them as stored: the CPU engine
    and the CUDA engine run them from their codes. What would re-quantize them, expand them, or has no MXFP4 matmul
    yet is refused before any work (exit 3)."""
    from llmc.compiler import prequantized_mxfp4

    options, target = plan.options, plan.target
    if options.mxfp4_activations not in ("float32", "int8"):
        raise LlmcError(f"--mxfp4-activations {options.mxfp4_activations!r}: choose float32 (exact, the default) or "
                        "int8")
    if not prequantized_mxfp4.carried(ckpt.tensors):
        if options.mxfp4_activations != "float32":
            raise LlmcError(f"{ckpt.path}: --mxfp4-activations {options.mxfp4_activations} applies to checkpoints "
                            "whose MoE experts are MXFP4 (gpt-oss as OpenAI ships it), and this one has none; leave "
                            "--mxfp4-activations out")
        return
    head = f"{ckpt.path}: the checkpoint's experts are MXFP4 (E2M1 codes + E8M0 scales, 4.25 bits per weight)"
    if options.quant.quant != "none":
        raise UnsupportedError(f"{head}; --quant {options.quant.quant} would re-quantize them; "
                               f"{prequantized_mxfp4.INSTEAD}, or build from the unquantized original")
    if (target.sm is not None or target.backend != "onnxruntime") and not uses_cuda_engine(options, target):
        raise UnsupportedError(f"{head}; {target.flag} --engine {options.engine}: TensorRT has no MXFP4 expert "
                               "matmul, and expanding the experts to bfloat16 would quadruple their memory; build "
                               "llmc's CUDA engine (leave --engine out) or --target cpu")
    if options.tp > 1:
        raise UnsupportedError(f"{head}; --tp {options.tp}: MXFP4 experts are not split across ranks yet; build "
                               "without --tp")
    if options.attention != "native":
        raise UnsupportedError(f"{head}; the MXFP4 expert matmul runs only in llmc's native ONNX Runtime op "
                               "library; build with the native attention route")
    if options.mxfp4_activations == "int8" and target.sm is not None:
        raise UnsupportedError(f"{head}; --mxfp4-activations int8 is a CPU-engine kernel (AVX-512 VNNI); the CUDA "
                               "engine multiplies the codes' values with its activations as they are: leave "
                               "--mxfp4-activations out")


def _lower_mxfp4(ckpt: Checkpoint, model, activations: str = "float32") -> int:
    """The routed expert matmuls over MXFP4 weights -> llmc.Mxfp4MoEMatMul on the checkpoint's codes (the CPU engine
    runs it in llmc's ONNX Runtime library, the CUDA engine as a torch op); with ``activations="int8"``,
    llmc.Mxfp4MoEMatMulQ8 on the same codes repacked (CPU engine)."""
    from llmc.compiler import prequantized_mxfp4

    carried = prequantized_mxfp4.carried(ckpt.tensors)
    if not carried:
        return 0
    from llmc.passes.mxfp4_experts import lower_mxfp4_experts

    return lower_mxfp4_experts(model, {name: w.source() for name, w in carried.items()}, q8=activations == "int8")


def _validate(options: BuildOptions) -> None:
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


def _check_cuda_request(options: BuildOptions, target: Target) -> BuildOptions:
    """What llmc's CUDA engine cannot build, refused before any work. Returns the options as the build runs
    them: the CUDA engine has no block-quantized embedding gather, so INT4 builds keep the embedding table in
    the engine dtype (the manifest's recipe says so)."""
    import dataclasses
    import importlib.util

    fmt = options.quant.format
    if fmt is not None and fmt.family == "nvfp4":
        raise UnsupportedError(f"--quant {fmt.name} on {target.flag}: the CUDA engine has no NVFP4 kernels yet; use "
                               "--quant fp8 or int4-awq, or --engine tensorrt for a TensorRT export")
    if options.quant.kv_cache_dtype == "fp16" and options.dtype != "float16":
        # The attention kernels read a cache in the engine's own dtype or as FP8 codes; a float16 cache beside
        # bfloat16 activations would be a third format for every kernel, for no memory saved.
        raise UnsupportedError(f"--kv-cache-dtype fp16 on {target.flag}: the CUDA engine's KV cache is in its "
                               f"compute dtype ({options.dtype}) or FP8; use --kv-cache-dtype fp8 (half the "
                               "memory), --dtype float16, or leave --kv-cache-dtype out")
    if options.aot_kernels and importlib.util.find_spec("triton") is None:
        raise UnsupportedError(f"{target.flag}: the CUDA engine's kernels are compiled ahead of time with Triton, "
                               "which is not installed here; pip install 'llmc[gpu]' (or triton) and build again")
    if options.quant.embeddings != "none":
        options = dataclasses.replace(options, quant=dataclasses.replace(options.quant, embeddings="none"))
    return options


def uses_cuda_engine(options: BuildOptions, target: Target) -> bool:
    """Whether this build writes llmc's CUDA engine (every GPU target, unless --engine tensorrt)."""
    return target.sm is not None and options.engine == "cuda"


def _check_gpu_request(options: BuildOptions, target: Target) -> BuildOptions:
    """GPU requests the target or this machine cannot honour, refused before any work. Returns the
    options as the GPU build runs them (TensorRT reads no ONNX Runtime block-quantized embeddings, so
    INT4 builds keep the embedding table in float16; the manifest's recipe says so)."""
    import dataclasses

    from llmc.compiler.backends import tensorrt as trt_backend

    if options.lora_slots:
        raise UnsupportedError(f"--lora-slots on {target.flag} --engine tensorrt: TensorRT exports have no LoRA slots; "
                               "build the CUDA engine (leave --engine out) or --target cpu")
    trt_backend.default_profile(options.max_batch_size, options.max_num_tokens, options.max_seq_len, None)
    if options.quant.kv_cache_dtype not in (None, "fp16") and target.backend == "tensorrt_rtx":
        raise UnsupportedError(f"--kv-cache-dtype {options.quant.kv_cache_dtype}: {target.flag} builds with TensorRT "
                               "for RTX, whose KV-cache update layer stores float16/bfloat16/float32 caches only; "
                               "leave --kv-cache-dtype out (KV cache in float16)")
    fmt = options.quant.format
    if fmt is not None and fmt.family == "int4" and not options.quant.symmetric:
        raise UnsupportedError(f"--quant {fmt.name} on {target.flag}: TensorRT's INT4 GEMMs take symmetric groups "
                               "(no zero points); add --symmetric")
    trt_backend.check_can_build(target, target.flag)
    if options.quant.embeddings != "none":
        options = dataclasses.replace(options, quant=dataclasses.replace(options.quant, embeddings="none"))
    return options


def _plan(out_dir: str | Path, options: BuildOptions) -> _Plan:
    """Every check on options and output that needs no checkpoint, before any work."""
    out = Path(out_dir)
    _validate(options)
    quant_recipe.validate(options.quant)
    if options.max_ppl_increase is not None and (not options.quant.enabled or options.max_ppl_increase < 0):
        raise LlmcError(f"--max-ppl-increase {options.max_ppl_increase:g}: needs a quantized build (--quant or "
                        "--kv-cache-dtype) and a limit of 0 or more percent")
    quant_recipe.check_target(options.quant, options.target, TARGETS)  # before get_target: name the constraint
    # A concrete calibration device before the recipe enters the cache key: GPU and CPU statistics differ in
    # their rounding, so their weights may too.
    options = replace(options, quant=quant_recipe.resolve_calib_device(options.quant))
    target = get_target(options.target)
    if options.tp > 1 and not uses_cuda_engine(options, target):
        raise UnsupportedError(f"--tp {options.tp} with {target.flag}: tensor parallelism splits llmc's CUDA engine "
                               "over GPUs; build for a GPU (--gpu h100 ...) or without --tp")
    if options.tp > 1 and options.lora_slots:
        raise UnsupportedError(f"--tp {options.tp} with --lora-slots: LoRA slots are not split across ranks yet; "
                               "build one of them")
    if uses_cuda_engine(options, target):
        options = _check_cuda_request(options, target)
    elif target.backend in GPU_BACKENDS:
        options = _check_gpu_request(options, target)
    if out.exists() and not options.force:
        raise LlmcError(f"{out}: output directory already exists; pass --force to replace it or choose another -o")
    if out.exists() and not out.is_dir():
        raise LlmcError(f"{out}: exists and is not a directory; choose another -o")
    return _Plan(out, options, target)


def _kill_point(name: str) -> None:
    # Fault injection for tests: LLMC_TEST_KILL_AT=<name>[:<SIGNAL>] sends this process SIGKILL (or
    # the named signal, e.g. INT) here, to prove that a build dying at any point leaves the cache
    # and the output consistent.
    point, _, sig = os.environ.get("LLMC_TEST_KILL_AT", "").partition(":")
    if point == name:
        os.kill(os.getpid(), getattr(signal, f"SIG{sig or 'KILL'}"))
    # LLMC_TEST_HOLD_AT=<name>:<MB> holds that much more memory from here on, to prove that the memory guard stops
    # a build past --max-memory with one line and leaves nothing behind.
    point, _, mb = os.environ.get("LLMC_TEST_HOLD_AT", "").partition(":")
    if point == name:
        import numpy as np

        for _ in range(max(1, int(mb) // 32)):  # in steps, as a build grows: the guard samples every 0.1 s
            _HELD.append(np.ones(32 << 20, np.uint8))
            time.sleep(0.02)
        time.sleep(1.0)


_HELD: list = []


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
    if not options.ep:
        del recipe["ep"]
    else:
        recipe["lora_targets"] = list(options.lora_targets)
    recipe.update(quant=quant_recipe.canonical(options.quant), compute_dtype=COMPUTE_DTYPE,
                  disabled_passes=sorted(set(options.disabled_passes)))
    return recipe


def _recipe_summary(recipe: dict) -> str:
    parts = [f"quant={quant_recipe.summary(recipe['quant'])}", f"block={recipe['block_size']}"]
    if recipe["disabled_passes"]:
        parts.append("no:" + ",".join(recipe["disabled_passes"]))
    if recipe.get("verify_passes"):
        parts.append("verify-passes")
    return " ".join(parts)


class _NoOnnxFiles:
    """GPU builds write no ONNX files into the artifact (their CPU twin for the accuracy check is temporary)."""

    model = weights = custom_ops = None
    fusions: dict[str, int] = {}


def _compile(ckpt: Checkpoint, digest: str, plan: _Plan, dest: Path, say: Progress, timings: dict[str, float],
             t0: float, info: dict | None = None) -> tuple[dict, dict]:
    """:func:`_compile_stages` under the memory guard: past ``--max-memory``, or with the machine about to run out,
    the build stops with one line (exit 5) instead of dying to the kernel's OOM killer; peak resident memory per
    stage goes to build_info.json."""
    from llmc import memory

    peaks = memory.StagePeaks()
    guard = memory.Guard(plan.options.max_memory, lambda: peaks.current or "the build",
                         exit_code=EXIT_OUT_OF_MEMORY, on_abort=lambda: shutil.rmtree(dest, ignore_errors=True))
    try:
        with guard:
            return _compile_stages(ckpt, digest, plan, dest, say, timings, t0, info, peaks)
    except memory.MemoryExceeded as exc:
        raise LlmcError(f"{exc}; no engine was written. {_memory_fix(plan.options.max_memory, plan.memory)}",
                        exit_code=EXIT_OUT_OF_MEMORY) from None


def _memory_fix(limit: int | None, estimate=None) -> str:
    need = f" (llmc's estimate for this build: {estimate.need / (1 << 30):.1f} GB)" if estimate is not None else ""
    if limit is not None:
        return f"Raise --max-memory{need}, or leave it out to use what the machine has"
    return (f"Free memory (other processes) or build where more is available{need}; --max-memory N sizes the "
            "build's rounds to N")


def _compile_stages(ckpt: Checkpoint, digest: str, plan: _Plan, dest: Path, say: Progress,
                    timings: dict[str, float], t0: float, info: dict | None, peaks) -> tuple[dict, dict]:
    """Stages 2-5: trace, optimise, emit and seal an artifact into the existing empty ``dest``.

    Returns (manifest, report). ``timings`` (seconds) is filled in; they, and ``info``, go to
    the unsealed build_info.json so that the sealed files depend on the inputs only.
    """
    from llmc.compiler.backends import onnxruntime as ort_backend
    from llmc.compiler.frontend import GRAPH_OUTPUTS, trace
    from llmc.compiler.pipeline import backend_fusion_enabled, passes_for, run_pipeline
    from llmc.passes.registry import BACKEND_FUSIONS

    options, target = plan.options, plan.target
    cuda = uses_cuda_engine(options, target)
    gpu = cuda or target.backend in GPU_BACKENDS
    qstage = None
    if options.quant.enabled:
        from llmc.compiler.binding import param_reader
        from llmc.quant.stage import QuantStage

        # GPU engines take INT4 as block-wise DequantizeLinear (TensorRT's INT4 GEMM form), not MatMulNBits.
        qstage = QuantStage(ckpt, options.quant, say, form="qdq" if gpu else "cpu", params=param_reader(ckpt),
                            memory=peaks)
        from llmc.compiler import prequantized_int4

        carried = prequantized_int4.carried(ckpt.tensors)
        if carried:  # the checkpoint's own INT4 weights (_carry_int4 set the recipe): the stage quantizes nothing
            qstage.calibration = prequantized_int4.int4_weights(carried)
        for warning in quant_recipe.check_target(options.quant, target.name, TARGETS):
            say(f"      warning: {warning}")
    # The quantize pass runs after the fusions, before the final dead-code elimination.
    passes = passes_for(target.name, options.disabled_passes,
                        (*options.extra_passes, qstage.graph_pass) if qstage else options.extra_passes)
    fusions = frozenset(n for n in BACKEND_FUSIONS if backend_fusion_enabled(n, options.disabled_passes))

    def stage(name: str, n: int) -> None:
        peaks.stop()
        peaks.start(_STAGE_KEYS[n])
        say(f"[{n}/5] {name}")

    check = pending = None
    # LLMC_SELF_CHECK=0 skips it (the test suite does, except where it tests the check: thousands of option
    # combinations would each pay for a twin); a user's build always runs it. It runs in a second process
    # beside tracing and the passes, and is joined before anything is emitted.
    if options.self_check and os.environ.get("LLMC_SELF_CHECK", "1") != "0":
        pending = _PendingSelfCheck.start(ckpt, plan, say)

    try:
        stage("trace with torch.export", 2)
        t = time.perf_counter()
        traced = trace(ckpt, compute_dtype=COMPUTE_DTYPE)
        lora = None
        if options.lora_slots:  # before any fusion: each linear is still MatMul(x, Transpose(W))
            from llmc.passes.lora import SLOT_INPUT, add_lora

            lora = add_lora(traced.model, options.lora_slots, options.max_lora_rank, tuple(options.lora_targets))
            traced.inputs = (*traced.inputs, SLOT_INPUT)
            say(f"      lora: {len(lora.sites)} linears, {lora.slots} slots of rank {lora.max_rank}")
        if traced.state_layers and ((gpu and not cuda) or options.verify_passes):
            raise UnsupportedError(f"{ckpt.path}: model_type {ckpt.model_type!r} has layers that keep recurrent state "
                                   "between tokens, which llmc builds for its CPU engine and its CUDA engine "
                                   "only, without --verify-passes, so far; build with --target cpu or --engine cuda, "
                                   "without --verify-passes")
        timings["trace"] = time.perf_counter() - t
        nodes_traced = sum(1 for _ in traced.model.graph)
        _kill_point("after-trace")

        stage(f"optimise graph ({len(passes)} passes{', verified' if options.verify_passes else ''})", 3)
        t = time.perf_counter()
        verifier = None
        if options.verify_passes:
            from llmc.compiler.verify import KVShape, PassVerifier

            # Random inputs drawn from a seed derived from the checkpoint digest: fresh per model, yet the
            # same for two builds of the same inputs, so the errors in report.json are reproducible.
            verifier = PassVerifier(traced.model, traced.vocab_size,
                                    KVShape(traced.num_layers, traced.num_kv_heads, traced.head_size,
                                            options.block_size, traced.kv_layers),
                                    seed=int(digest.removeprefix("sha256:")[:16], 16))
        pass_stats = run_pipeline(traced.model, passes, verify=verifier, progress=lambda name: say(f"      {name}"))
        if lora is not None and not gpu:  # the CUDA backend lowers each update on its own (LoraApply)
            from llmc.passes.lora import fold_into_packed

            fold_into_packed(traced.model)
            if verifier is not None:
                verifier("fold-lora-updates", traced.model)
        mxfp4 = _lower_mxfp4(ckpt, traced.model, options.mxfp4_activations) if cuda or not gpu else 0
        if verifier is not None:
            for entry in pass_stats:
                entry["verified_rel_error"] = verifier.errors.get(entry["pass"])
        timings["passes"] = time.perf_counter() - t
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        t = time.perf_counter()
        check = pending.result()  # raises UnsupportedError (exit 3) on a mismatch, before any output
        timings["self_check"] = check.seconds
        timings["self_check_wait"] = time.perf_counter() - t  # what it added to this build's wall time
        info = {**(info or {}), "self_check": {"status": check.status, "seconds": check.seconds,
                                               "waited_s": round(timings["self_check_wait"], 3),
                                               "max_logprob_error": check.max_logprob_error,
                                               "max_logit_rel_error": check.max_logit_rel_error}}

    stage(f"emit {'cuda' if cuda else target.backend} engine (streaming weights)", 4)
    t = time.perf_counter()
    if cuda:
        from llmc.compiler.backends import cuda as cuda_backend

        cpu_graph = traced.model.clone() if qstage is not None else None
        sm = int(target.sm.replace(".", ""))
        cuda_files = cuda_backend.emit(traced.model, dest, sm=sm, dtype=options.dtype, block_size=options.block_size,
                                       say=say, aot=options.aot_kernels, tp=options.tp, ep=options.ep)
        files = _NoOnnxFiles()
        files.fusions = cuda_files.fusions
    elif gpu:
        from llmc.compiler.backends import tensorrt as trt_backend

        # The accuracy check runs the quantized graph (before TensorRT lowering) on the CPU.
        cpu_graph = traced.model.clone() if qstage is not None else None
        profile = trt_backend.default_profile(options.max_batch_size, options.max_num_tokens, options.max_seq_len,
                                              ckpt.config.get("max_position_embeddings"))
        timing_dir = (plan.cache_root or Store(None).root) / "trt-timing"
        gpu_engine, gpu_kv, gpu_details = trt_backend.emit(traced.model, dest, target, profile, timing_dir, say)
        info = {**(info or {}), "engine_build": gpu_details}
        files = _NoOnnxFiles()
    else:
        files = ort_backend.emit(traced.model, dest, options.attention, fusions, say=say)
    fused = files.fusions
    timings["emit"] = time.perf_counter() - t
    _kill_point("after-emit")

    stage("write artifact", 5)
    copied = artifact.copy_tokenizer(ckpt.path, dest)
    report = {
        # An engine without tokenizer.json takes token ids only (`llmc run --prompt-ids`); say so in the report.
        "tokenizer": {"files": sorted(f for f in copied if f in artifact.TOKENIZER_FILES), "text": ckpt.has_tokenizer},
        "passes": pass_stats,
        "graph": {"nodes_traced": nodes_traced, "nodes_final": sum(1 for _ in traced.model.graph)},
        "backend_fusions": fused,
        # What the build proved (timings and cached-or-fresh go to build_info.json: they differ between builds).
        "self_check": ({"result": "passed", "key": check.key, "twin_config": check.twin} if check is not None
                       else {"result": "not run"}),
    }
    if ckpt.source_quantization is not None:  # a pre-quantized checkpoint, dequantized exactly on the way in
        report["source_quantization"] = ckpt.source_quantization
    if mxfp4:  # what the engine kept of an MXFP4 checkpoint: its experts as codes
        report["mxfp4"] = {"matmuls": mxfp4, "op": "llmc.Mxfp4MoEMatMul", "bits_per_weight": 4.25,
                           "activations": "float32 (exact)"}
        if options.mxfp4_activations == "int8":
            report["mxfp4"].update(op="llmc.Mxfp4MoEMatMulQ8", activations=(
                "int8 per 32-element block, scale max|x| / 127 (llama.cpp's MXFP4 x Q8_0 trade; not exact: "
                "--mxfp4-activations int8)"))
    if qstage is not None:
        report.update(qstage.report())
    artifact.write_json(dest / "report.json", report)
    fields = {
        "source": {"model_type": ckpt.model_type, "digest": digest, "dtype": ckpt.dtype},
        "recipe": {"quant": quant_recipe.canonical(options.quant), "compute_dtype": traced.compute_dtype,
                   "passes": [p.name for p in passes] + [name for name, n in fused.items() if n]},
        "target": {"name": target.name, "backend": target.backend},
        "toolchain": artifact.toolchain_versions(),
        "engine": {
            "backend": target.backend,
            "model_file": files.model,
            "weights_file": files.weights,
            "inputs": list(traced.inputs),
            "outputs": list(GRAPH_OUTPUTS),
            "vocab_size": traced.vocab_size,
            "custom_ops": files.custom_ops,
            # longrope: sequences growing past this length recompute their KV with the long factors.
            **({"rope_recompute_at": traced.rope_recompute_at} if traced.rope_recompute_at else {}),
        },
        "kv_cache": {
            "layout": KV_LAYOUT,
            "block_size": options.block_size,
            # --kv-cache-dtype fp16 stores the CPU cache as float16 (the kernel converts on write and read);
            # fp8 is emulated in the graph and keeps the compute dtype here.
            "dtype": "float16" if options.quant.kv_cache_dtype == "fp16" else traced.compute_dtype,
            "num_layers": traced.num_layers,
            "num_kv_heads": traced.num_kv_heads,
            "head_size": traced.head_size,
            "num_heads": traced.num_heads,
            # Layers of other KV geometries (Gemma 4) or sharing an earlier layer's cache: see
            # llmc.runtime.kv_cache.layer_geometry. num_kv_heads / head_size are then the first layer's.
            **({"layers": traced.kv_layers} if traced.kv_layers else {}),
        },
        # Hybrid models: the per-sequence state of their recurrent layers (llmc.runtime.state_cache).
        **({"state_cache": {"dtype": "float32", "arrays": traced.state_layers}} if traced.state_layers else {}),
        # Multi-LoRA engines: slots, rank, and per linear its graph inputs (llmc.runtime.lora reads it).
        **({"lora": lora.to_json()} if lora is not None else {}),
    }
    cpu_fields = fields
    if cuda:
        cpu_fields = {**fields, "engine": {**fields["engine"], "backend": "onnxruntime"},
                      "target": {"name": "cpu", "backend": "onnxruntime"}, "toolchain": dict(fields["toolchain"])}
        fields["engine"] = {
            "backend": "cuda", "kind": "cuda", "sm": target.sm, "dtype": cuda_files.dtype,
            "program_file": cuda_files.program, "weights_file": cuda_files.weights, "kernels": cuda_files.kernels,
            "inputs": list(traced.inputs), "outputs": list(GRAPH_OUTPUTS), "vocab_size": traced.vocab_size,
            **({"rope_recompute_at": traced.rope_recompute_at} if traced.rope_recompute_at else {}),
        }
        # The cache holds what the kernels write: the engine dtype, or E4M3 codes (--kv-cache-dtype fp8).
        fields["kv_cache"] = {**fields["kv_cache"], "dtype": cuda_files.kv_cache_dtype}
        if cuda_files.parallel is not None:  # --tp: the rank files (compiler/sharding.py)
            fields["parallel"] = cuda_files.parallel
        fields["target"] = {"name": target.name, "backend": "cuda", "sm": target.sm}
        fields["toolchain"] = {**fields["toolchain"], **_cuda_toolchain(int(target.sm.replace(".", "")))}
    elif gpu:  # the CPU form of the same graph (for the accuracy check) keeps the ONNX Runtime fields
        cpu_fields = {**fields, "engine": {**fields["engine"], "backend": "onnxruntime"},
                      "target": {"name": "cpu", "backend": "onnxruntime"}, "toolchain": dict(fields["toolchain"])}
        fields["engine"] = {**gpu_engine, "vocab_size": traced.vocab_size}
        fields["kv_cache"] = gpu_kv
        fields["target"]["sm"] = target.sm
        fields["toolchain"] = {**fields["toolchain"], **trt_backend.toolchain(target.backend)}
    manifest = artifact.seal(dest, fields)
    if qstage is not None:  # score the sealed engine against the unquantized graph, then re-seal with the figures
        from llmc.quant.layerwise import KVShape

        # The reference is the unquantized graph with the cache in the compute dtype (--kv-cache-dtype is scored),
        # run layer by layer as the CPU backend lowers it.
        kv = cpu_fields["kv_cache"]
        reference_kv = KVShape(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv["block_size"],
                               traced.compute_dtype, kv.get("layers"), fields.get("state_cache"))

        def lower(model) -> None:
            ort_backend.lower(model, options.attention, fusions)

        # A CUDA engine is scored itself, on the GPU, where torch sees one; otherwise (and for TensorRT) the same
        # quantized graph is scored on the CPU, lowered as the CPU backend would, without writing it out.
        scoring_device = _scoring_device(manifest) if cuda else None
        quantized_graph = None
        if gpu and scoring_device is None:
            lower(cpu_graph)
            quantized_graph = cpu_graph
        # The unquantized scores depend on the checkpoint and llmc alone: builds of other recipes reuse them.
        accuracy = qstage.evaluate(
            dest, lower, reference_kv, ort_backend.CUSTOM_OPS[options.attention], quantized_graph=quantized_graph,
            quantized_kv=KVShape(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv["block_size"],
                                 kv["dtype"], kv.get("layers"), fields.get("state_cache")),
            round_tokens=plan.round_tokens,
            device=scoring_device,
            scored=("the engine's quantized graph (onnxruntime, on the CPU; the GPU engine itself did not run)"
                    if quantized_graph is not None else None),
            reference_cache=(plan.cache_root or Store(None).root) / "reference",
            reference_key=f"{digest} {sources_digest(_PACKAGE_ROOT)} "
                          f"{json.dumps(cpu_fields['toolchain'], sort_keys=True)}")
        cpu_graph = None
        report.update(qstage.report())
        artifact.write_json(dest / "report.json", report)
        manifest = artifact.seal(dest, fields)
        timings.update({f"quant_{k}": v for k, v in qstage.timings.items()})
        from llmc.quant.evaluate import check_gate

        check_gate(accuracy, options.max_ppl_increase, qstage.name)
    peaks.stop()
    timings["total"] = time.perf_counter() - t0
    build_info = {"timings_s": {k: round(v, 3) for k, v in timings.items()}, **(info or {}),
                  "memory": {"peak_rss_gb": peaks.figures, "exact": peaks.exact,
                             "max_memory_gb": round(options.max_memory / GB, 3) if options.max_memory else None,
                             "estimate": plan.memory.to_json() if plan.memory is not None else None,
                             "round_tokens": plan.round_tokens}}
    artifact.write_build_info(dest, build_info)
    os.chmod(dest, 0o755)
    return manifest, report


_STAGE_KEYS = {2: "trace", 3: "passes", 4: "emit", 5: "write"}
GB = 1 << 30





def _scoring_device(manifest: dict) -> str | None:
    """Where the CUDA engine of ``manifest`` is scored: ``"cuda"`` where it runs on this machine's GPU, else None
    (its quantized graph on the CPU). ``LLMC_SCORE_CUDA_ENGINE_ON=cpu`` runs the CUDA engine's own program on the
    CPU instead (the tests' way through this path without a GPU)."""
    forced = os.environ.get("LLMC_SCORE_CUDA_ENGINE_ON")
    if forced:
        return forced
    import torch

    return "cuda" if torch.cuda.is_available() and runtime_artifact.cuda_problem(manifest) is None else None


def _self_check_child(ckpt: Checkpoint, plan: _Plan) -> tuple[str, object]:
    """The self-check in a worker process: ("ok", SelfCheckResult) or ("refused", message)."""
    try:
        return "ok", _self_check(ckpt, plan, lambda _msg: None)
    except UnsupportedError as exc:
        return "refused", str(exc)


class _PendingSelfCheck:
    """The self-check running beside the build, in a second Python process (``python -m
    llmc.compiler.selfcheck_worker``: a twin's tracing is single-threaded Python like the real build's, so on
    two cores it costs little wall time; a plain subprocess, not multiprocessing, so a caller's script is never
    re-imported), or in this process when the result is cached, the build does not pickle (a test-only pass
    made in a closure), or the worker dies without an answer."""

    def __init__(self, result=None, proc=None, files=None, args=None):
        self._result, self._proc, self._files, self._args = result, proc, files, args

    @classmethod
    def start(cls, ckpt: Checkpoint, plan: _Plan, say: Progress) -> _PendingSelfCheck:
        import pickle
        import subprocess
        import sys

        cached = _self_check(ckpt, plan, say, lookup_only=True)
        if cached is not None:
            return cls(result=cached)
        try:
            blob = pickle.dumps((ckpt, plan))
        except Exception:  # noqa: BLE001 - e.g. a test-only pass defined in a closure: check in this process
            return cls(result=_self_check(ckpt, plan, say))
        say(f"      self-check: a random twin of this {ckpt.model_type} config through the same pipeline, "
            "against transformers (in a second process, beside the build)")
        from llmc.compiler.selfcheck import SCRATCH_PREFIX, mark_scratch

        work = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX + "job-"))
        mark_scratch(work)
        (work / "in.pkl").write_bytes(blob)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the caller's modules
        with open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "llmc.compiler.selfcheck_worker", str(work)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        return cls(proc=proc, files=work, args=(ckpt, plan, say))

    def cancel(self) -> None:
        """Stop the worker (the build failed or was interrupted first)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._files is not None:
            shutil.rmtree(self._files, ignore_errors=True)

    def result(self):
        if self._proc is None:
            return self._result
        import pickle

        try:
            self._proc.wait()
            out = self._files / "out.pkl"
            if self._proc.returncode != 0 or not out.is_file():
                tail = (self._files / "stderr.txt").read_text(errors="replace")[-2000:]
                logging.getLogger("llmc").debug("self-check worker exited %s without an answer: %s",
                                                self._proc.returncode, tail)
                ckpt, plan, say = self._args
                return _self_check(ckpt, plan, say)  # the check is not optional: run it here
            status, payload = pickle.loads(out.read_bytes())
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            shutil.rmtree(self._files, ignore_errors=True)
        if status == "refused":
            raise UnsupportedError(payload)
        return payload


def _self_check(ckpt: Checkpoint, plan: _Plan, say: Progress, lookup_only: bool = False):
    """The architecture self-check for this build (see compiler/selfcheck.py); raises UnsupportedError on a mismatch.

    The twin is built unquantized, in float32, for the same target where the runtime here can execute it
    (the CPU, or a CUDA engine on torch's CPU ops); a TensorRT export's twin is checked as a CPU engine (its
    graph is the same up to the TensorRT lowering).
    """
    import dataclasses

    from llmc.compiler import selfcheck

    options, target = plan.options, plan.target
    cuda = uses_cuda_engine(options, target)
    twin_options = dataclasses.replace(
        options, target=target.name if cuda or target.sm is None else "cpu", quant=QuantRecipe(),
        max_ppl_increase=None, force=True, verify_passes=False, self_check=False, aot_kernels=False,
        dtype="float32", lora_slots=0, tp=1,  # the twin checks the architecture; tests/test_lora.py the LoRA slots
        mxfp4_activations="float32")  # a twin has no MXFP4 experts (tests/test_prequantized_mxfp4.py: the Q8 op)
    lowering = {k: v for k, v in canonical_recipe(twin_options).items() if k not in ("quant",)}

    def build_twin(twin_ckpt: Path, out: Path, **overrides) -> None:
        # overrides: the diagnosis's variants of the same build (verified passes, fusions off)
        if "disabled_passes" in overrides:
            overrides["disabled_passes"] = (*twin_options.disabled_passes, *overrides["disabled_passes"])
        build(twin_ckpt, out, dataclasses.replace(twin_options, **overrides))

    return selfcheck.run(ckpt.config, ckpt.model_type, build_twin, lowering, artifact.toolchain_versions(),
                         sources_digest(_PACKAGE_ROOT), plan.cache_root or Store(None).root, cuda,
                         cacheable=not options.extra_passes, say=say, lookup_only=lookup_only)


def build(checkpoint_dir: str | Path, out_dir: str | Path, options: BuildOptions | None = None,
          progress: Progress | None = None) -> BuildResult:
    """Build an engine for ``options.target`` from the checkpoint into ``out_dir`` (no build cache).

    Raises :class:`LlmcError` for bad input before any output exists.
    """
    options = options or BuildOptions()
    say = progress or (lambda msg: None)
    plan = _plan(out_dir, options)
    out = plan.out
    from llmc.compiler.pipeline import passes_for

    passes_for(plan.target.name, options.disabled_passes, options.extra_passes)  # bad pass names: fail now
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    say("[1/5] load checkpoint")
    ckpt = load_checkpoint(checkpoint_dir)
    _plan_memory(ckpt, plan)
    _check_hybrid(ckpt, plan)
    _check_tp(ckpt, plan)
    _carry_int4(ckpt, plan)
    _carry_mxfp4(ckpt, plan)
    digest = ckpt.digest()
    timings["load"] = time.perf_counter() - t0

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        manifest, report = _compile(ckpt, digest, plan, tmp, say, timings, t0)
        build_info = json.loads((tmp / runtime_artifact.BUILD_INFO).read_text())
        digest_out = runtime_artifact.artifact_digest(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out_dir=out, manifest=manifest, report=report, timings=timings, build_info=build_info,
                       artifact_digest=digest_out)


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "absent"


def _cuda_toolchain(sm: int) -> dict[str, str]:
    """What made the CUDA engine's kernels: Triton and the CUDA release of its ptxas (the driver must run it)."""
    from llmc.compiler.backends.cuda import ptxas_cuda_version

    return {"triton": _triton_version(), "ptxas_cuda": ptxas_cuda_version(sm) or "unknown"}


def _builder_toolchain(target: Target, options: BuildOptions | None = None) -> dict[str, str]:
    if options is not None and uses_cuda_engine(options, target):
        return {"triton": _triton_version()}
    if target.backend not in GPU_BACKENDS:
        return {}
    from llmc.compiler.backends import tensorrt as trt_backend

    return trt_backend.toolchain(target.backend)


def cache_key_inputs(ckpt_digest: str, plan: _Plan) -> KeyInputs:
    """What the cache key of building a checkpoint with content digest ``ckpt_digest`` by ``plan`` covers."""
    return KeyInputs(
        checkpoint_digest=ckpt_digest,
        recipe=canonical_recipe(plan.options),
        target={"name": plan.target.name, "sm": plan.target.sm,
                "backend": "cuda" if uses_cuda_engine(plan.options, plan.target) else plan.target.backend},
        toolchain={**artifact.toolchain_versions(), **_builder_toolchain(plan.target, plan.options)},
        llmc_version=llmc.__version__,
        sources_digest=sources_digest(_PACKAGE_ROOT),
    )


class _CorruptEntry(Exception):
    pass


def build_cached(checkpoint_dir: str | Path, out_dir: str | Path, options: BuildOptions | None = None,
                 progress: Progress | None = None, *, cache_dir: str | Path | None = None,
                 refresh: bool = False) -> BuildResult:
    """:func:`build` through the build cache at ``cache_dir`` (default: see :func:`llmc.build_cache.default_root`).

    On a hit the stored artifact is copied to ``out_dir`` (and checked against its manifest on
    the way; a damaged entry is evicted and rebuilt). On a miss, or with ``refresh``
    (``--no-cache``), the engine is compiled into the store, published atomically, then copied.
    Concurrent calls for one key compile once: the others wait for the first and reuse its entry.

    The key needs the checkpoint's content digest, so every call reads the checkpoint files once
    (a miss reads the weights a second time while emitting, mostly from the page cache).
    Builds with ``extra_passes`` (Python objects the key cannot capture) bypass the cache.
    """
    options = options or BuildOptions()
    if options.extra_passes:
        return build(checkpoint_dir, out_dir, options, progress)
    say = progress or (lambda msg: None)
    plan = _plan(out_dir, options)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    say("[1/5] load checkpoint")
    ckpt = load_checkpoint(checkpoint_dir)
    _plan_memory(ckpt, plan)
    _check_hybrid(ckpt, plan)
    _check_tp(ckpt, plan)
    _carry_int4(ckpt, plan)
    _carry_mxfp4(ckpt, plan)
    digest = ckpt.digest()
    timings["load"] = time.perf_counter() - t0

    t = time.perf_counter()
    inputs = cache_key_inputs(digest, plan)
    key = inputs.key()
    store = Store(cache_dir)
    plan.cache_root = store.root
    try:
        store.locks_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmcError(f"{store.root}: build cache directory is not writable ({exc.strerror}); pass --cache-dir "
                        "or set LLMC_CACHE_DIR to a writable directory") from None
    timings["key"] = time.perf_counter() - t

    with store.lock(key, on_wait=lambda: say(f"      waiting for another llmc build of {key[:16]} to finish")):
        entry = None if refresh else store.get(key)
        if entry is not None:
            t = time.perf_counter()
            try:
                _export(entry.artifact, plan.out)
            except _CorruptEntry as exc:
                # A warning, not progress: it shows under --json too (stderr), where progress lines do not.
                logging.getLogger("llmc").warning("cache entry %s is damaged (%s); evicting it and rebuilding",
                                                  key[:16], exc)
                store.remove_locked(key)
                entry = None
            else:
                store.touch(entry)
                timings["copy"] = time.perf_counter() - t
                say(f"      cache hit {key[:16]}: copied {entry.artifact} -> {plan.out}")
        hit = entry is not None
        if entry is None:
            say(f"      cache {'refresh' if refresh else 'miss'} {key[:16]}: building")
            with store.staging(key) as staged:
                dest = staged / "artifact"
                dest.mkdir()
                _compile(ckpt, digest, plan, dest, say, timings, t0, info={"cache_key": key})
                _kill_point("before-publish")
                meta = {
                    "key_inputs": asdict(inputs),
                    "model": {"model_type": ckpt.model_type, "name": ckpt.path.resolve().name, "dtype": ckpt.dtype},
                    "target": plan.target.name,
                    "recipe_summary": _recipe_summary(inputs.recipe),
                    "artifact_digest": runtime_artifact.artifact_digest(dest),
                }
                entry = store.publish(key, staged, meta)
            _kill_point("after-publish")
            t = time.perf_counter()
            try:
                _export(entry.artifact, plan.out)
            except _CorruptEntry as exc:  # we just built and sealed it: a bug, not bad input
                raise RuntimeError(f"freshly built cache entry {key} fails verification: {exc}") from None
            timings["copy"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    out = plan.out
    return BuildResult(
        out_dir=out,
        manifest=runtime_artifact.read_manifest(out),
        report=json.loads((out / "report.json").read_text()),
        timings=timings,
        build_info=json.loads((out / runtime_artifact.BUILD_INFO).read_text()),
        cache_hit=hit,
        key=key,
        artifact_digest=runtime_artifact.artifact_digest(out),
    )


def _export(artifact_dir: Path, out: Path) -> None:
    """Copy a cached artifact to ``out`` (through a temporary sibling and a rename), checking every
    file against the manifest; raises :class:`_CorruptEntry` if the cached copy is damaged."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # copyfile, not copy2: the output gets ordinary writable files, not the store's read-only ones.
        shutil.copytree(artifact_dir, tmp, dirs_exist_ok=True, copy_function=shutil.copyfile)
        try:
            problems = runtime_artifact.verify(tmp)
        except LlmcError as exc:
            raise _CorruptEntry(str(exc)) from None
        if problems:
            raise _CorruptEntry(str(problems[0]))
        os.chmod(tmp, 0o755)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished build into place; an existing output (with --force) is replaced only now."""
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)
