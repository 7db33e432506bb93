"""The build's compile stages, in order (:data:`STAGES`), each a short function of the :class:`BuildState`.

load and check run first, in :mod:`llmc.compiler.build.driver` (before the build cache is consulted); then
quantize (set up the quantization stage, whose graph pass joins the pipeline), self-check (start the twin beside
the build), trace, passes, self-check-join, emit (the backend), write (report + sealed manifest), score (the
accuracy report of a quantized build, and its gate) and finish (build_info.json).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmc.compiler.build.faults import kill_point
from llmc.compiler.build.options import COMPUTE_DTYPE
from llmc.compiler.build.self_check import PendingSelfCheck
from llmc.compiler.build.self_check import enabled as self_check_enabled
from llmc.compiler.build.state import BuildState
from llmc.errors import UnsupportedError
from llmc.quant import recipe as quant_recipe

GB = 1 << 30


def quantize(s: BuildState) -> None:
    """The quantization stage (llmc.quant.stage) and the pass pipeline it joins: its graph pass runs after the
    fusions, before the final dead-code elimination."""
    from llmc.compiler.pipeline import backend_fusion_enabled, passes_for
    from llmc.compiler.targets import TARGETS
    from llmc.passes.registry import BACKEND_FUSIONS

    options, target, ckpt = s.plan.options, s.plan.target, s.ckpt
    if options.quant.enabled:
        from llmc.compiler import prequantized_int4
        from llmc.compiler.binding import param_reader
        from llmc.quant.stage import QuantStage

        # GPU engines take INT4 as block-wise DequantizeLinear (TensorRT's INT4 GEMM form), not MatMulNBits.
        s.qstage = QuantStage(ckpt, options.quant, s.say, form="qdq" if s.plan.backend.gpu else "cpu",
                              params=param_reader(ckpt), memory=s.peaks)
        carried = prequantized_int4.carried(ckpt.tensors)
        if carried:  # the checkpoint's own INT4 weights (checks.carry_int4 set the recipe): nothing to quantize
            s.qstage.calibration = prequantized_int4.int4_weights(carried)
        for warning in quant_recipe.check_target(options.quant, target.name, TARGETS):
            s.say(f"      warning: {warning}")
    extra = (*options.extra_passes, s.qstage.graph_pass) if s.qstage else options.extra_passes
    s.passes = passes_for(target.name, options.disabled_passes, extra)
    s.fusions = frozenset(n for n in BACKEND_FUSIONS if backend_fusion_enabled(n, options.disabled_passes))


def start_self_check(s: BuildState) -> None:
    """The architecture self-check, in a second process beside tracing and the passes (joined before emit)."""
    if self_check_enabled(s.plan):
        s.pending = PendingSelfCheck.start(s.ckpt, s.plan, s.say, s.build)


def trace(s: BuildState) -> None:
    """The checkpoint's own transformers classes traced into an ONNX IR graph (compiler/frontend.py)."""
    from llmc.compiler.frontend import trace as trace_model
    from llmc.compiler.provenance import strip_source_locations
    from llmc.compiler.vision_encoder import trace_size

    options, backend = s.plan.options, s.plan.backend
    s.phase("trace with torch.export", 2)
    t = time.perf_counter()
    processor = _image_processor(s)
    s.traced = trace_model(s.ckpt, compute_dtype=COMPUTE_DTYPE, image_size=trace_size(
        s.ckpt.model_type, processor.config, s.ckpt.path) if processor is not None else None)
    s.traced.image_processor = processor
    strip_source_locations(s.traced.model)  # install paths and line numbers: engines the same wherever built
    if options.lora_slots:  # before any fusion: each linear is still MatMul(x, Transpose(W))
        from llmc.passes import recipe
        from llmc.passes.lora import SLOT_INPUT

        made = recipe.Outcome()
        recipe.lora_slots(options.lora_slots, options.max_lora_rank, tuple(options.lora_targets), made).run(
            s.traced.model)
        s.lora = made.value
        s.traced.inputs = (*s.traced.inputs, SLOT_INPUT)
        s.say(f"      lora: {len(s.lora.sites)} linears, {s.lora.slots} slots of rank {s.lora.max_rank}")
    if s.traced.state_layers and (not backend.runs_state or options.verify_passes):
        raise UnsupportedError(f"{s.ckpt.path}: model_type {s.ckpt.model_type!r} has layers that keep recurrent "
                               "state between tokens, which llmc builds for its CPU engine and its CUDA engine "
                               "only, without --verify-passes, so far; build with --target cpu or --engine cuda, "
                               "without --verify-passes")
    s.timings["trace"] = time.perf_counter() - t
    s.nodes_traced = sum(1 for _ in s.traced.model.graph)
    kill_point("after-trace")


def _image_processor(s: BuildState):
    """An image build's image processor (llmc.runtime.vision): the checkpoint's own JSON, else the family's
    defaults at the encoder's image size (said in the progress lines); None for other builds."""
    from llmc.compiler import vision_encoder

    config = s.ckpt.config
    if not vision_encoder.builds_images(config, s.plan.options.text_only):
        return None
    from llmc.runtime.vision import processor_for, read_checkpoint_json

    raw = read_checkpoint_json(s.ckpt.path)
    if raw is None and vision_encoder.uses_mrope(s.ckpt.model_type):  # the family's pixel range, the encoder's patches
        vision = config["vision_config"]
        raw = {k: vision[f] for k, f in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                                         ("temporal_patch_size", "temporal_patch_size")) if f in vision}
        s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor")
    elif raw is None and s.ckpt.model_type == "gemma4":  # the family's patch budget, the encoder's patches
        vision = config["vision_config"]
        raw = {k: vision[k] for k in ("patch_size", "pooling_kernel_size") if k in vision}
        s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor")
    elif s.ckpt.model_type in vision_encoder.TILES_FAMILIES:
        from llmc.compiler import idefics3_vision

        if raw is None:
            s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor")
        processor = processor_for(s.ckpt.model_type, idefics3_vision.processor_json(raw, config))
        idefics3_vision.check_tile(processor.config, config, s.ckpt.path)
        idefics3_vision.layout(processor.config, s.ckpt.path)  # its tokens from the tokenizer, before any work
        return processor
    elif s.ckpt.model_type in vision_encoder.SEPARATOR_FAMILIES:
        from llmc.compiler import llama4_vision

        if raw is None:
            s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor")
        processor = processor_for(s.ckpt.model_type, llama4_vision.processor_json(raw, config))
        llama4_vision.check_tile(processor.config, config, s.ckpt.path)
        llama4_vision.layout(s.ckpt.path)  # its tokens from the tokenizer, before any work
        return processor
    elif vision_encoder.rows_family(s.ckpt.model_type):
        # PixtralProcessor resizes to whole merged patches: the tower's patch times the merger's side
        vision = config["vision_config"]
        side = int(vision.get("patch_size", 16)) * int(config.get("spatial_merge_size", 2))
        if raw is None:
            raw = {"size": {"longest_edge": int(vision.get("image_size", 1024))}}
            s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor")
        raw = {**raw, "patch_size": {"height": side, "width": side}}
    elif raw is None:
        side = int(config["vision_config"].get("image_size", 224))
        raw = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        s.say(f"      images: no preprocessor_config.json: {s.ckpt.model_type}'s default processor at {side}x{side}")
    return processor_for(s.ckpt.model_type, raw)


def _verifier(s: BuildState):
    from llmc.compiler.verify import KVShape, PassVerifier

    traced = s.traced
    # Random inputs drawn from a seed derived from the checkpoint digest: fresh per model, yet the same for two
    # builds of the same inputs, so the errors in report.json are reproducible.
    return PassVerifier(traced.model, traced.vocab_size,
                        KVShape(traced.num_layers, traced.num_kv_heads, traced.head_size,
                                s.plan.options.block_size, traced.kv_layers),
                        seed=int(s.digest.removeprefix("sha256:")[:16], 16))


def passes(s: BuildState) -> None:
    """The graph pipeline (compiler/pipeline.py), each pass checked against the graph before it under
    --verify-passes; then the rewrites that depend on the backend: LoRA updates folded into packed projections
    (engines that keep them as graph ops) and MXFP4 experts lowered onto their codes."""
    from llmc.compiler.pipeline import run_pipeline

    options, model = s.plan.options, s.traced.model
    s.phase(f"optimise graph ({len(s.passes)} passes{', verified' if options.verify_passes else ''})", 3)
    t = time.perf_counter()
    s.verifier = _verifier(s) if options.verify_passes else None
    s.pass_stats = run_pipeline(model, s.passes, verify=s.verifier, progress=lambda name: s.say(f"      {name}"))
    for graph_pass in _after_pipeline(s):
        graph_pass.run(model)
        if s.verifier is not None and graph_pass.name == "fold-lora-updates":
            s.verifier(graph_pass.name, model)
    s.mxfp4 = s.mxfp4_outcome.value if s.mxfp4_outcome is not None else 0
    if s.verifier is not None:
        for entry in s.pass_stats:
            entry["verified_rel_error"] = s.verifier.errors.get(entry["pass"])
    s.timings["passes"] = time.perf_counter() - t


def _after_pipeline(s: BuildState) -> list:
    """The recipe's passes after the pipeline (llmc.passes.recipe): LoRA updates folded into packed projections
    (the CUDA backend lowers each update on its own: LoraApply), MXFP4 experts onto the checkpoint's codes (the CPU
    engine runs them in llmc's ONNX Runtime library, the CUDA engine as a torch op; ``--mxfp4-activations int8``:
    llmc.Mxfp4MoEMatMulQ8 on the same codes repacked)."""
    from llmc.compiler import prequantized_mxfp4
    from llmc.passes import recipe

    out = []
    if s.lora is not None and not s.plan.backend.gpu:
        out.append(recipe.fold_lora_updates())
    carried = prequantized_mxfp4.carried(s.ckpt.tensors) if s.plan.backend.lowers_mxfp4 else None
    if carried:
        made = recipe.Outcome(value=0)
        s.mxfp4_outcome = made
        sources = {name: w.source() for name, w in carried.items()}
        out.append(recipe.mxfp4_experts(sources, s.plan.options.mxfp4_activations == "int8", made))
    return out


def join_self_check(s: BuildState) -> None:
    """Wait for the twin: a mismatch raises UnsupportedError (exit 3) before any output."""
    if s.pending is None:
        return
    t = time.perf_counter()
    check = s.check = s.pending.result()
    s.timings["self_check"] = check.seconds
    s.timings["self_check_wait"] = time.perf_counter() - t  # what it added to this build's wall time
    s.info = {**s.info, "self_check": {"status": check.status, "seconds": check.seconds,
                                       "waited_s": round(s.timings["self_check_wait"], 3),
                                       "max_logprob_error": check.max_logprob_error,
                                       "max_logit_rel_error": check.max_logit_rel_error}}


def emit(s: BuildState) -> None:
    """The backend writes the engine's files (compiler/backends/registry.py chose it)."""
    from llmc.compiler.backends.protocol import EmitJob

    plan, backend = s.plan, s.plan.backend
    s.phase(f"emit {'cuda' if backend.name == 'cuda' else plan.target.backend} engine (streaming weights)", 4)
    t = time.perf_counter()
    job = EmitJob(s.traced.model, s.dest, plan.options, plan.target, s.ckpt.config, s.say, plan.cache_root,
                  quantized=s.qstage is not None, fusions=s.fusions)
    s.emitted = backend.emit(job)
    s.info = {**s.info, **s.emitted.info}
    for name, path in plan.options.extra_graphs:
        import onnx_ir as ir

        s.graphs[name] = backend.emit_graph(name, ir.load(path), job)
    for name, graph in s.traced.graphs.items():  # graphs the trace made beside the language model (an encoder)
        s.graphs[name] = backend.emit_graph(name, graph, job)
    s.timings["emit"] = time.perf_counter() - t
    kill_point("after-emit")


def write(s: BuildState) -> None:
    """report.json and the sealed manifest (compiler/build/manifest.py assembles it)."""
    from llmc.compiler import artifact
    from llmc.compiler.build.manifest import fields, report

    s.phase("write artifact", 5)
    copied = artifact.copy_tokenizer(s.ckpt.path, s.dest)
    if s.traced.image_processor is not None:  # what the runtime's image processor reproduces (llmc.runtime.vision)
        from llmc.runtime.vision import write_config

        write_config(s.traced.image_processor.config, s.dest)
    s.report = report(s, copied)
    artifact.write_json(s.dest / "report.json", s.report)
    s.fields, s.cpu_fields = fields(s)
    s.manifest = artifact.seal(s.dest, s.fields)


def score(s: BuildState) -> None:
    """A quantized build: the sealed engine scored against the unquantized graph (llmc.quant.evaluate), the figures
    sealed in, then the accuracy gate (exit 4)."""
    if s.qstage is None:
        return
    from llmc.compiler.build.scoring import score_quantized

    score_quantized(s)


def finish(s: BuildState) -> None:
    """build_info.json: timings and peak memory per stage (unsealed: they differ between builds)."""
    from llmc.compiler import artifact

    options, plan = s.plan.options, s.plan
    s.peaks.stop()
    s.timings["total"] = time.perf_counter() - s.t0
    build_info = {"timings_s": {k: round(v, 3) for k, v in s.timings.items()}, **s.info,
                  "memory": {"peak_rss_gb": s.peaks.figures, "exact": s.peaks.exact,
                             "max_memory_gb": round(options.max_memory / GB, 3) if options.max_memory else None,
                             "estimate": plan.memory.to_json() if plan.memory is not None else None,
                             "round_tokens": plan.round_tokens}}
    artifact.write_build_info(s.dest, build_info)
    os.chmod(s.dest, 0o755)


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[BuildState], None]


# The compile stages, in order (load and check precede them: llmc.compiler.build.driver.prepare).
STAGES: tuple[Stage, ...] = (
    Stage("quantize", quantize),
    Stage("self-check", start_self_check),
    Stage("trace", trace),
    Stage("passes", passes),
    Stage("self-check-join", join_self_check),
    Stage("emit", emit),
    Stage("write", write),
    Stage("score", score),
    Stage("finish", finish),
)
