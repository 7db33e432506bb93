"""The score stage of a quantized build: the sealed engine against the unquantized graph, the figures sealed into
the artifact, and the accuracy gate (``--max-ppl-increase``, exit 4)."""

from __future__ import annotations

import json
import os

from llmc.build_cache import Store, sources_digest
from llmc.compiler import artifact
from llmc.compiler.build.self_check import package_root
from llmc.compiler.build.state import BuildState
from llmc.runtime import artifact as runtime_artifact


def scoring_device(manifest: dict) -> str | None:
    """Where the CUDA engine of ``manifest`` is scored: ``"cuda"`` where it runs on this machine's GPU, else None
    (its quantized graph on the CPU). ``LLMC_SCORE_CUDA_ENGINE_ON=cpu`` runs the CUDA engine's own program on the
    CPU instead (the tests' way through this path without a GPU)."""
    forced = os.environ.get("LLMC_SCORE_CUDA_ENGINE_ON")
    if forced:
        return forced
    import torch

    return "cuda" if torch.cuda.is_available() and runtime_artifact.cuda_problem(manifest) is None else None


def score_quantized(s: BuildState) -> None:
    from llmc.compiler.backends import onnxruntime as ort_backend
    from llmc.quant.evaluate import check_gate
    from llmc.quant.layerwise import KVShape

    options, backend, qstage = s.plan.options, s.plan.backend, s.qstage
    # The reference is the unquantized graph with the cache in the compute dtype (--kv-cache-dtype is scored),
    # run layer by layer as the CPU backend lowers it.
    kv, state = s.cpu_fields["kv_cache"], s.fields.get("state_cache")
    reference_kv = KVShape(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv["block_size"],
                           s.traced.compute_dtype, kv.get("layers"), state)

    def lower(model) -> None:
        ort_backend.lower(model, options.attention, s.fusions)

    # A CUDA engine is scored itself, on the GPU, where torch sees one; otherwise (and for TensorRT) the same
    # quantized graph is scored on the CPU, lowered as the CPU backend would, without writing it out.
    device = scoring_device(s.manifest) if backend.name == "cuda" else None
    quantized_graph = None
    if backend.gpu and device is None:
        lower(s.emitted.cpu_graph)
        quantized_graph = s.emitted.cpu_graph
    cache_root = s.plan.cache_root or Store(None).root
    # The unquantized scores depend on the checkpoint and llmc alone: builds of other recipes reuse them.
    accuracy = qstage.evaluate(
        s.dest, lower, reference_kv, ort_backend.CUSTOM_OPS[options.attention], quantized_graph=quantized_graph,
        quantized_kv=KVShape(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv["block_size"],
                             kv["dtype"], kv.get("layers"), state),
        round_tokens=s.plan.round_tokens,
        device=device,
        scored=("the engine's quantized graph (onnxruntime, on the CPU; the GPU engine itself did not run)"
                if quantized_graph is not None else None),
        reference_cache=cache_root / "reference",
        reference_key=f"{s.digest} {sources_digest(package_root())} "
                      f"{json.dumps(s.cpu_fields['toolchain'], sort_keys=True)}")
    s.emitted.cpu_graph = None
    s.report.update(qstage.report())
    artifact.write_json(s.dest / "report.json", s.report)
    s.manifest = artifact.seal(s.dest, s.fields)
    s.timings.update({f"quant_{k}": v for k, v in qstage.timings.items()})
    check_gate(accuracy, options.max_ppl_increase, qstage.name)
