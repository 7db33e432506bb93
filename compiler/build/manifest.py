"""The artifact's report.json and manifest fields, assembled from what the stages and the backend produced."""

from __future__ import annotations

from llmc.compiler import artifact
from llmc.compiler.build.state import BuildState
from llmc.plugins.paged_attention import KV_LAYOUT
from llmc.quant import recipe as quant_recipe


def report(s: BuildState, copied: list[str]) -> dict:
    """report.json: what the build did and proved (timings and cached-or-fresh go to build_info.json: they differ
    between builds)."""
    ckpt, options, traced = s.ckpt, s.plan.options, s.traced
    check = s.check
    out = {
        # An engine without tokenizer.json takes token ids only (`llmc run --prompt-ids`); say so in the report.
        "tokenizer": {"files": sorted(f for f in copied if f in artifact.TOKENIZER_FILES), "text": ckpt.has_tokenizer},
        "passes": s.pass_stats,
        "graph": {"nodes_traced": s.nodes_traced, "nodes_final": sum(1 for _ in traced.model.graph)},
        "backend_fusions": s.emitted.fusions,
        "self_check": ({"result": "passed", "key": check.key, "twin_config": check.twin} if check is not None
                       else {"result": "not run"}),
    }
    if ckpt.source_quantization is not None:  # a pre-quantized checkpoint, dequantized exactly on the way in
        out["source_quantization"] = ckpt.source_quantization
    if s.mxfp4:  # what the engine kept of an MXFP4 checkpoint: its experts as codes
        out["mxfp4"] = {"matmuls": s.mxfp4, "op": "llmc.Mxfp4MoEMatMul", "bits_per_weight": 4.25,
                        "activations": "float32 (exact)"}
        if options.mxfp4_activations == "int8":
            out["mxfp4"].update(op="llmc.Mxfp4MoEMatMulQ8", activations=(
                "int8 per 32-element block, scale max|x| / 127 (llama.cpp's MXFP4 x Q8_0 trade; not exact: "
                "--mxfp4-activations int8)"))
    if s.qstage is not None:
        out.update(s.qstage.report())
    return out


def _graph_fields(s: BuildState) -> dict:
    """The manifest as an ONNX Runtime engine of this graph records it; a GPU backend rewrites its own sections."""
    from llmc.compiler.frontend import GRAPH_OUTPUTS

    ckpt, options, traced, target, emitted = s.ckpt, s.plan.options, s.traced, s.plan.target, s.emitted
    fused = emitted.fusions
    return {
        "source": {"model_type": ckpt.model_type, "digest": s.digest, "dtype": ckpt.dtype},
        "recipe": {"quant": quant_recipe.canonical(options.quant), "compute_dtype": traced.compute_dtype,
                   "passes": [p.name for p in s.passes] + [name for name, n in fused.items() if n]},
        "target": {"name": target.name, "backend": target.backend},
        "toolchain": artifact.toolchain_versions(),
        "engine": {
            "backend": target.backend,
            "model_file": emitted.model_file,
            "weights_file": emitted.weights_file,
            "inputs": list(traced.inputs),
            "outputs": list(GRAPH_OUTPUTS),
            "vocab_size": traced.vocab_size,
            "custom_ops": emitted.custom_ops,
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
            # llmc.runtime.core.kv_cache.layer_geometry. num_kv_heads / head_size are then the first layer's.
            **({"layers": traced.kv_layers} if traced.kv_layers else {}),
        },
        # Hybrid models: the per-sequence state of their recurrent layers (llmc.runtime.core.state_cache).
        **({"state_cache": {"dtype": "float32", "arrays": traced.state_layers}} if traced.state_layers else {}),
        # Multi-LoRA engines: slots, rank, and per linear its graph inputs (read by llmc.runtime.lora).
        **({"lora": s.lora.to_json()} if s.lora is not None else {}),
        # A vision-language checkpoint built --text-only: which wrapper, and the encoders left out.
        # or with its vision encoder: the placeholder token, tokens per image, the encoder graph.
        **({"multimodal": _multimodal(ckpt.config, traced)} if options.text_only or traced.images else {}),
    }


def _multimodal(config: dict, traced) -> dict:
    from llmc.compiler.multimodal import image_text_class, manifest_entry

    if traced.images is None:
        return manifest_entry(config)
    from llmc.compiler.vision_encoder import manifest_entry as image_entry
    from llmc.runtime.vision.config import ARTIFACT_FILE

    return image_entry(image_text_class(str(config.get("model_type"))), traced.images, ARTIFACT_FILE)


def fields(s: BuildState) -> tuple[dict, dict]:
    """(the manifest's fields, the same graph's fields as a CPU engine: what the accuracy report runs). Further
    graphs of the artifact (an encoder beside the language model) go under ``graphs``, each with its files."""
    graph = _graph_fields(s)
    backend = s.plan.backend
    if not backend.gpu:
        out, cpu = graph, graph
    else:
        cpu = {**graph, "engine": {**graph["engine"], "backend": "onnxruntime"},
               "target": {"name": "cpu", "backend": "onnxruntime"}, "toolchain": dict(graph["toolchain"])}
        out = backend.manifest(graph, s.emitted, s.plan.target)
    if s.graphs:
        out = {**out, "graphs": dict(sorted(s.graphs.items()))}
    return out, cpu
