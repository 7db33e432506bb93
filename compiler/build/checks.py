"""The build's "check" stage: what the checkpoint itself rules out or changes, before any work.

Each function takes the loaded checkpoint and the plan, refuses (exit 3) what cannot be built, names the missing
piece, and may narrow the plan's options (a checkpoint that arrives quantized keeps its codes).
"""

from __future__ import annotations

import dataclasses

from llmc.compiler.build.plan import Plan
from llmc.compiler.checkpoint import Checkpoint
from llmc.compiler.targets import TARGETS
from llmc.errors import LlmcError, UnsupportedError
from llmc.quant import recipe as quant_recipe


def plan_memory(ckpt: Checkpoint, plan: Plan) -> None:
    """Refuse, before any work, a build whose estimate exceeds --max-memory (exit 5); size its rounds to it."""
    from llmc.compiler import memory_plan

    plan.memory, plan.round_tokens = memory_plan.check(plan.options.max_memory, ckpt.tensors, ckpt.config,
                                                       plan.options.quant)


def check_hybrid(ckpt: Checkpoint, plan: Plan) -> None:
    """What a hybrid model (layers with recurrent state: llmc.compiler.checkpoint.HYBRID_MODEL_TYPES) cannot be
    built with yet, refused before any work (exit 3), naming the missing piece."""
    from llmc.compiler.checkpoint import HYBRID_MODEL_TYPES

    layers = HYBRID_MODEL_TYPES.get(ckpt.model_type)
    if layers is None:
        return
    options, target = plan.options, plan.target
    head = f"{ckpt.path}: model_type {ckpt.model_type!r} has {layers}, which keep recurrent state between tokens"
    if plan.backend.name != "cuda" and (target.sm is not None or target.backend != "onnxruntime"):
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


def check_tp(ckpt: Checkpoint, plan: Plan) -> None:
    """--tp N: what the sharding pass (compiler/sharding.py) cannot split, refused before any work (exit 3)."""
    from llmc.compiler import sharding

    options = plan.options
    if options.tp > 1:
        fmt = options.quant.format
        group = options.quant.group_size if fmt is not None and fmt.family == "int4" else None
        sharding.check_config(ckpt.config, options.tp, str(ckpt.path / "config.json"), group, ep=options.ep)


def carry_int4(ckpt: Checkpoint, plan: Plan) -> None:
    """A checkpoint that arrives in INT4 (compiler/prequantized_int4.py: AutoAWQ GEMM, GPTQ) keeps its weights: the
    build's recipe becomes INT4 with the checkpoint's group size and zero points, the embeddings and LM head stay as
    stored, and the INT4 stage takes the checkpoint's codes instead of quantizing (never dequantize and re-quantize).
    A request that would re-quantize them, or a target without this path yet, is refused before any work (exit 3)."""
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
    if target.sm is not None and plan.backend.name != "cuda":
        raise UnsupportedError(f"{head}; {target.flag} --engine tensorrt: TensorRT's INT4 GEMMs take symmetric groups, "
                               "which would re-quantize it; build the CUDA engine (leave --engine out) or --target cpu")
    if target.sm is not None and options.dtype == "bfloat16":
        # The CUDA engine keeps INT4 group scales in its compute dtype: float16 scales are exact in float16/float32.
        raise UnsupportedError(f"{head}; {target.flag} --dtype bfloat16 would round its float16 scales to bfloat16; "
                               "build with --dtype float16 (or float32)")
    recipe = dataclasses.replace(q, quant="int4", group_size=group, symmetric=False, embeddings="none", lm_head="none")
    quant_recipe.check_target(recipe, target.name, TARGETS)
    plan.rechoose(dataclasses.replace(options, quant=recipe))


def carry_mxfp4(ckpt: Checkpoint, plan: Plan) -> None:
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
    if not plan.backend.lowers_mxfp4:
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


def check_encoders(ckpt: Checkpoint, plan: Plan) -> None:
    """A vision-language checkpoint: a family whose images llmc places (compiler/vision_encoder.py) builds with its
    vision encoder, with what that combines with so far; any other only --text-only (exit 3)."""
    from llmc.compiler import multimodal, vision_encoder

    cfg_path = ckpt.path / "config.json"
    if vision_encoder.builds_images(ckpt.config, plan.options.text_only):
        vision_encoder.refuse_options(cfg_path, ckpt.model_type, plan.options, plan.backend.name)
        multimodal.refuse_other_encoders(ckpt.config, ckpt.model_type, cfg_path)
        return
    vision_encoder.refuse_family(cfg_path, ckpt.model_type, plan.options.text_only)
    multimodal.refuse_encoders(ckpt.config, ckpt.model_type, cfg_path, plan.options.text_only)
    if plan.options.text_only and not multimodal.encoders(ckpt.config):
        raise LlmcError(f"{ckpt.path / 'config.json'}: --text-only builds the text model of a vision-language "
                        f"checkpoint, and model_type {ckpt.model_type!r} has no encoder; leave --text-only out")


# The check stage, in order.
CHECKS = (plan_memory, check_encoders, check_hybrid, check_tp, carry_int4, carry_mxfp4)
