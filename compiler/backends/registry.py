"""The backends a build can use, in the order the build asks them (:func:`backend_for`).

Each class here is light: choosing a backend, its refusals and its toolchain happen before any work and on cache
hits, so the modules that emit (torch, onnx_ir, TensorRT) are imported only inside :meth:`emit`.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from llmc.compiler.backends.protocol import Backend, EmitJob, Emitted
from llmc.compiler.targets import GPU_BACKENDS
from llmc.errors import UnsupportedError


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "absent"


def _keep_embeddings(options):
    """GPU engines have no block-quantized embedding gather: INT4 builds keep the table in the engine dtype (the
    manifest's recipe says so)."""
    if options.quant.embeddings != "none":
        options = dataclasses.replace(options, quant=dataclasses.replace(options.quant, embeddings="none"))
    return options


def _no_further_graphs(options, target, backend: str) -> None:
    if options.extra_graphs:
        raise UnsupportedError(f"{target.flag} --engine {backend}: artifacts with further graphs (an encoder beside "
                               "the language model) are built for the CPU engine so far; build with --target cpu")


def _refuse_graph(backend: str):
    def emit_graph(self, name: str, model, job) -> dict:
        raise UnsupportedError(f"the {backend} backend emits no further graphs yet ({name!r}); build with --target "
                               "cpu")

    return emit_graph


def _cpu_twin(model, quantized: bool):
    """The graph before a GPU backend lowers it: the accuracy report scores it on the CPU when no GPU runs it."""
    return model.clone() if quantized else None


class OnnxRuntimeBackend:
    """The CPU engine: the graph lowered to what ONNX Runtime runs (compiler/backends/onnxruntime.py) plus llmc's
    custom-op library."""

    name, gpu, runs_state, lowers_mxfp4 = "onnxruntime", False, True, True

    def handles(self, options, target) -> bool:
        return True  # what no other backend takes

    def check_request(self, options, target):
        return options

    def toolchain(self, target, options) -> dict[str, str]:
        return {}

    def lowering_passes(self, options, fusions: frozenset[str]) -> list:
        from llmc.compiler.backends import onnxruntime

        return onnxruntime.lowering_passes(options.attention, fusions)

    def emit(self, job: EmitJob) -> Emitted:
        from llmc.compiler.backends import onnxruntime

        files = onnxruntime.emit(job.model, job.dest, job.options.attention, job.fusions, say=job.say)
        return Emitted(fusions=files.fusions, model_file=files.model, weights_file=files.weights,
                       custom_ops=files.custom_ops, files=files)

    def emit_graph(self, name: str, model, job: EmitJob) -> dict:
        from llmc.compiler.backends import onnxruntime

        return onnxruntime.emit_graph(name, model, job.dest)

    def manifest(self, fields: dict, emitted: Emitted, target) -> dict:
        return fields


class CudaBackend:
    """llmc's CUDA engine: a torch program over the graph and Triton kernels compiled ahead of time
    (compiler/backends/cuda.py), built with no GPU."""

    name, gpu, runs_state, lowers_mxfp4 = "cuda", True, True, True

    def handles(self, options, target) -> bool:
        return target.sm is not None and options.engine == "cuda"

    def check_request(self, options, target):
        fmt = options.quant.format
        if fmt is not None and fmt.family == "nvfp4":
            raise UnsupportedError(f"--quant {fmt.name} on {target.flag}: the CUDA engine has no NVFP4 kernels yet; "
                                   "use --quant fp8 or int4-awq, or --engine tensorrt for a TensorRT export")
        if options.quant.kv_cache_dtype == "fp16" and options.dtype != "float16":
            # The attention kernels read a cache in the engine's own dtype or as FP8 codes; a float16 cache beside
            # bfloat16 activations would be a third format for every kernel, for no memory saved.
            raise UnsupportedError(f"--kv-cache-dtype fp16 on {target.flag}: the CUDA engine's KV cache is in its "
                                   f"compute dtype ({options.dtype}) or FP8; use --kv-cache-dtype fp8 (half the "
                                   "memory), --dtype float16, or leave --kv-cache-dtype out")
        if options.aot_kernels and importlib.util.find_spec("triton") is None:
            raise UnsupportedError(f"{target.flag}: the CUDA engine's kernels are compiled ahead of time with Triton, "
                                   "which is not installed here; pip install 'llmc[gpu]' (or triton) and build again")
        _no_further_graphs(options, target, "cuda")
        return _keep_embeddings(options)

    def emit_graph(self, name: str, model, job: EmitJob) -> dict:
        """A further graph (an encoder) as its own program with its AOT kernels, in the engine's dtype."""
        from llmc.compiler.backends import cuda

        o = job.options
        return cuda.emit_graph(name, model, job.dest, sm=int(job.target.sm.replace(".", "")), dtype=o.dtype,
                               aot=o.aot_kernels, say=job.say)

    def toolchain(self, target, options) -> dict[str, str]:
        return {"triton": _triton_version()}

    def lowering_passes(self, options, fusions: frozenset[str]) -> list:
        return []  # the program is written node by node (compiler/backends/cuda.py); no graph rewrite precedes it

    def emit(self, job: EmitJob) -> Emitted:
        from llmc.compiler.backends import cuda

        cpu_graph = _cpu_twin(job.model, job.quantized)
        o = job.options
        files = cuda.emit(job.model, job.dest, sm=int(job.target.sm.replace(".", "")), dtype=o.dtype,
                          block_size=o.block_size, say=job.say, aot=o.aot_kernels, tp=o.tp, ep=o.ep)
        return Emitted(fusions=files.fusions, files=files, cpu_graph=cpu_graph)

    def manifest(self, fields: dict, emitted: Emitted, target) -> dict:
        from llmc.compiler.backends.cuda import ptxas_cuda_version

        files, graph, sm = emitted.files, fields["engine"], target.sm
        fields = dict(fields)
        fields["engine"] = {
            "backend": "cuda", "kind": "cuda", "sm": sm, "dtype": files.dtype,
            "program_file": files.program, "weights_file": files.weights, "kernels": files.kernels,
            "inputs": graph["inputs"], "outputs": graph["outputs"], "vocab_size": graph["vocab_size"],
            **({"rope_recompute_at": graph["rope_recompute_at"]} if "rope_recompute_at" in graph else {}),
        }
        # The cache holds what the kernels write: the engine dtype, or E4M3 codes (--kv-cache-dtype fp8).
        fields["kv_cache"] = {**fields["kv_cache"], "dtype": files.kv_cache_dtype}
        if files.parallel is not None:  # --tp: the rank files (compiler/sharding.py)
            fields["parallel"] = files.parallel
        fields["target"] = {"name": fields["target"]["name"], "backend": "cuda", "sm": sm}
        # What made the kernels: Triton and the CUDA release of its ptxas (the driver must run it).
        fields["toolchain"] = {**fields["toolchain"], "triton": _triton_version(),
                               "ptxas_cuda": ptxas_cuda_version(int(sm.replace(".", ""))) or "unknown"}
        return fields


class TensorRTBackend:
    """A TensorRT or TensorRT-for-RTX engine (compiler/backends/tensorrt.py): an export, built where its builder
    is installed."""

    name, gpu, runs_state, lowers_mxfp4 = "tensorrt", True, False, False

    def handles(self, options, target) -> bool:
        return target.backend in GPU_BACKENDS

    def check_request(self, options, target):
        from llmc.compiler.backends import tensorrt

        if options.lora_slots:
            raise UnsupportedError(f"--lora-slots on {target.flag} --engine tensorrt: TensorRT exports have no LoRA "
                                   "slots; build the CUDA engine (leave --engine out) or --target cpu")
        tensorrt.default_profile(options.max_batch_size, options.max_num_tokens, options.max_seq_len, None)
        if options.quant.kv_cache_dtype not in (None, "fp16") and target.backend == "tensorrt_rtx":
            raise UnsupportedError(f"--kv-cache-dtype {options.quant.kv_cache_dtype}: {target.flag} builds with "
                                   "TensorRT for RTX, whose KV-cache update layer stores float16/bfloat16/float32 "
                                   "caches only; leave --kv-cache-dtype out (KV cache in float16)")
        fmt = options.quant.format
        if fmt is not None and fmt.family == "int4" and not options.quant.symmetric:
            raise UnsupportedError(f"--quant {fmt.name} on {target.flag}: TensorRT's INT4 GEMMs take symmetric "
                                   "groups (no zero points); add --symmetric")
        _no_further_graphs(options, target, "tensorrt")
        tensorrt.check_can_build(target, target.flag)
        # TensorRT reads no ONNX Runtime block-quantized embeddings.
        return _keep_embeddings(options)

    emit_graph = _refuse_graph("tensorrt")

    def toolchain(self, target, options) -> dict[str, str]:
        from llmc.compiler.backends import tensorrt

        return tensorrt.toolchain(target.backend)

    def lowering_passes(self, options, fusions: frozenset[str]) -> list:
        from llmc.passes.tensorrt import LOWERING

        return list(LOWERING)

    def emit(self, job: EmitJob) -> Emitted:
        from llmc.build_cache import Store
        from llmc.compiler.backends import tensorrt

        cpu_graph = _cpu_twin(job.model, job.quantized)
        o = job.options
        profile = tensorrt.default_profile(o.max_batch_size, o.max_num_tokens, o.max_seq_len,
                                           job.config.get("max_position_embeddings"))
        timing_dir = (job.cache_root or Store(None).root) / "trt-timing"
        engine, kv, details = tensorrt.emit(job.model, job.dest, job.target, profile, timing_dir, job.say)
        return Emitted(files=(engine, kv), cpu_graph=cpu_graph, info={"engine_build": details})

    def manifest(self, fields: dict, emitted: Emitted, target) -> dict:
        from llmc.compiler.backends import tensorrt

        engine, kv = emitted.files
        return {**fields, "engine": {**engine, "vocab_size": fields["engine"]["vocab_size"]}, "kv_cache": kv,
                "target": {**fields["target"], "sm": target.sm},
                "toolchain": {**fields["toolchain"], **tensorrt.toolchain(target.backend)}}


# Asked in this order: the first that handles a build builds it.
BACKENDS: tuple[Backend, ...] = (CudaBackend(), TensorRTBackend(), OnnxRuntimeBackend())


def backend_for(options, target) -> Backend:
    """The backend that builds ``options`` for ``target``."""
    return next(b for b in BACKENDS if b.handles(options, target))
