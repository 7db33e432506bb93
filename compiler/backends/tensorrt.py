"""TensorRT and TensorRT for RTX backend: lowered ONNX graph → strongly typed network → serialized engine.

One code path serves both builders; :class:`Builder` holds what differs between them:

- ``tensorrt`` (data-centre GPUs): builds on the GPU it targets (it times kernels there), so a
  build needs that GPU and the ``tensorrt`` wheel on the build machine.
- ``tensorrt_rtx`` (GeForce RTX): builds ahead of time with no GPU for the compute capabilities
  it is given (``IBuilderConfig.set_compute_capability``) and compiles kernels just in time on the
  device. It has no plugin API, so PagedAttention is lowered to its native KV-cache update and
  attention layers (:mod:`llmc.passes.tensorrt.lowering`); the full TensorRT path uses the same lowering.

Both networks are strongly typed (TensorRT 11 and TensorRT for RTX are always strongly typed;
TensorRT 10 gets the ``STRONGLY_TYPED`` flag): precision comes from the graph's types (float16
compute, FP8 / FP4 / INT4 ``DequantizeLinear`` on quantized weights), so there are no precision
builder flags to set per format; the format only selects which quantized forms the graph holds.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx_ir as ir

from llmc.errors import LlmcError, UnsupportedError
from llmc.passes.tensorrt import lowering as trt_lowering
from llmc.runtime.artifact import local_gpus  # one nvidia-smi probe for the builder and the loader

ENGINE_FILE = "engine.plan"
# Workspace for the builder's tactics; the runtime allocates activations separately.
WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class Builder:
    """What differs between the two TensorRT flavours."""

    backend: str
    module: str
    product: str
    distribution: str
    version: str  # the pinned version llmc is tested with
    needs_gpu: bool  # True: builds only on the GPU it targets
    # TensorRT times tactics on the GPU and keeps the results in a timing cache; TensorRT for RTX picks
    # kernels without timing (they compile just in time on the device) and its timing-cache calls are
    # deprecated no-ops since 1.2, so it gets none.
    timing_cache: bool

    @property
    def install(self) -> str:
        return f"pip install {self.distribution}=={self.version}"


BUILDERS = {
    "tensorrt": Builder("tensorrt", "tensorrt", "NVIDIA TensorRT", "tensorrt-cu13", "11.4.0.106", True, True),
    "tensorrt_rtx": Builder("tensorrt_rtx", "tensorrt_rtx", "NVIDIA TensorRT for RTX", "tensorrt-rtx-cu13",
                            "1.7.1.116", False, False),
}


@dataclass(frozen=True)
class Profile:
    """The shapes one engine serves: up to ``max_batch_size`` sequences and ``max_num_tokens`` new tokens
    per step, each sequence at most ``max_seq_len`` tokens long (the KV slots' length)."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int


def import_builder(backend: str, target_flag: str):
    """Import the builder module for ``backend``; raise :class:`UnsupportedError` saying what to install."""
    builder = BUILDERS[backend]
    try:
        return importlib.import_module(builder.module)
    except ImportError as exc:
        raise UnsupportedError(
            f"{target_flag} builds with {builder.product} (Python module '{builder.module}'), which does not import "
            f"here ({exc}); install it with `{builder.install}`"
            + (" on a machine with that GPU and an NVIDIA driver for CUDA 13 (TensorRT builds on the GPU it "
               "targets)" if builder.needs_gpu else "")) from None


def check_can_build(target, target_flag: str) -> None:
    """Fail before any work if this machine cannot build for ``target`` (missing builder or GPU)."""
    builder = BUILDERS[target.backend]
    import_builder(target.backend, target_flag)
    if builder.needs_gpu:
        found = local_gpus()
        if not any(cc == target.sm for _, cc in found):
            have = ", ".join(f"{n} (compute capability {cc})" for n, cc in found) or "no NVIDIA GPU"
            raise UnsupportedError(
                f"{target_flag} ({target.description}, compute capability {target.sm}): {builder.product} builds "
                f"engines on the GPU they target, and this machine has {have}; run the build on a machine with "
                f"an {target.description}, or build for an RTX target (--gpu rtx4090 / rtx5090), which TensorRT "
                "for RTX builds ahead of time without a GPU")


def toolchain(backend: str) -> dict[str, str]:
    """The builder's version, for the manifest and the build-cache key."""
    trt = importlib.import_module(BUILDERS[backend].module)
    return {backend: trt.__version__}


def _compute_capability(trt, sm: str):
    name = "SM" + sm.replace(".", "")
    cc = getattr(trt.ComputeCapability, name, None)
    if cc is None:
        raise UnsupportedError(f"compute capability {sm}: {BUILDERS['tensorrt_rtx'].product} "
                               f"{trt.__version__} cannot build for it")
    return cc


class _Logger:
    """A TensorRT logger that keeps errors (for the exception) and passes warnings to ``say``."""

    def __init__(self, trt, say: Callable[[str], None]):
        self.messages: list[str] = []
        outer = self

        class Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)

            def log(self, severity, msg):
                if severity <= trt.ILogger.Severity.ERROR:
                    outer.messages.append(msg)

        self.logger = Logger()
        self.say = say


def _tensor(network, name: str):
    """The network tensor called ``name`` (a layer output), or None."""
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            t = layer.get_output(j)
            if t is not None and t.name == name:
                return t
    return None


def _QUANT_LAYERS(trt) -> tuple:  # noqa: N802 - a constant of the imported module
    return (trt.LayerType.QUANTIZE, trt.LayerType.DEQUANTIZE, trt.LayerType.DYNAMIC_QUANTIZE)


def _finish_network(trt, network) -> dict[str, int]:
    """Network edits the ONNX form cannot express (see trt_lowering):

    - KV-cache updates read the packed ``[T, heads, D]`` K/V with the cumulative token counts
      (``AttentionIOForm.PACKED_NHD``), so each sequence writes exactly its new tokens (the padded
      ONNX form would also write padding rows past them);
    - attention layers may decompose where no fused kernel matches the head size.
    """
    cu = None
    stats = {"kv_updates_packed": 0, "attention": 0}
    seen = set()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.KV_CACHE_UPDATE:
            layer.__class__ = trt.IKVCacheUpdateLayer  # the bindings' way to downcast an ILayer
            out_name = layer.get_output(0).name  # present_{kind}.{layer}
            kind, _, index = out_name.removeprefix("present_").partition(".")
            packed = _tensor(network, trt_lowering.PACKED_NAME.format(kind=kind, layer=index))
            if packed is None:
                raise RuntimeError(f"TensorRT network: no packed {kind} tensor for {out_name}")
            if cu is None:
                qsl = next(network.get_input(j) for j in range(network.num_inputs)
                           if network.get_input(j).name == "query_start_loc")
                cast = network.add_cast(qsl, trt.int32)
                cast.name = "llmc/cu_seqlens_i32"
                cu = cast.get_output(0)
            layer.update_form = trt.AttentionIOForm.PACKED_NHD
            layer.set_input(1, packed)
            layer.update_lengths = cu
            stats["kv_updates_packed"] += 1
        elif layer.type in _QUANT_LAYERS(trt):
            # What precision the strongly typed network runs its quantized GEMMs in: count the
            # quantize / dequantize layers by their low-precision type.
            low = layer.get_output(0).dtype if layer.type != trt.LayerType.DEQUANTIZE else layer.get_input(0).dtype
            key = f"{layer.type.name.lower()}_{low.name.lower()}"
            stats[key] = stats.get(key, 0) + 1
        elif layer.type == trt.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.IAttentionInputLayer
            attention = layer.attention
            if id(attention) not in seen:
                attention.decomposable = True
                seen.add(id(attention))
                stats["attention"] += 1
    return stats


def _profile_shapes(network, profile: Profile) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) of every input: tokens in [1, max_num_tokens] (opt: one decode step of a full
    batch), sequences in [1, max_batch_size]; KV slots [sequences, heads, max_seq_len, D]."""
    b, t = profile.max_batch_size, profile.max_num_tokens
    opt_t = min(t, b)
    shapes = {}
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        name, dims = inp.name, tuple(inp.shape)
        if name in ("input_ids", "positions", "rope_lengths"):
            shapes[name] = ((1,), (opt_t,), (t,))
        elif name == "logits_indices":
            shapes[name] = ((1,), (min(b, t),), (t,))
        elif name == "context_lens":
            shapes[name] = ((1,), (b,), (b,))
        elif name == "query_start_loc":
            shapes[name] = ((2,), (b + 1,), (b + 1,))
        elif name.startswith("past_"):
            rest = dims[1:]
            shapes[name] = ((1, *rest), (b, *rest), (b, *rest))
        else:
            raise RuntimeError(f"TensorRT network input {name!r} has no optimisation profile rule")
    return shapes


@dataclass
class EngineBuild:
    plan_bytes: int
    build_s: float
    timing_cache: dict
    network: dict
    io: list[dict]
    profiles: list[dict]


def _timing_cache_file(cache_dir: Path, backend: str, version: str, sm: str) -> Path:
    return cache_dir / f"{backend}-{version}-sm{sm.replace('.', '')}.cache"


def _build_with_timing_cache(builder, network, config, log: _Logger, builder_info: Builder, cache_file: Path):
    """Build with the timing cache in ``cache_file`` loaded first and saved after (atomically), under
    a lock so that concurrent builds for the same builder version and SM share it."""
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_file.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        loaded = cache_file.read_bytes() if cache_file.is_file() else b""
        cache = config.create_timing_cache(loaded)
        config.set_timing_cache(cache, False)
        t = time.perf_counter()
        plan = builder.build_serialized_network(network, config)
        build_s = time.perf_counter() - t
        if plan is None:
            raise RuntimeError(f"{builder_info.product} failed to build the engine: " + "; ".join(log.messages))
        saved = memoryview(cache.serialize())
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_bytes(saved)
        os.replace(tmp, cache_file)
    return plan, build_s, {"used": True, "file": str(cache_file), "bytes_before": len(loaded),
                           "bytes_after": len(saved), "reused": bool(loaded)}


def build_engine(onnx_path: Path, out_file: Path, target, profile: Profile, timing_dir: Path,
                 say: Callable[[str], None]) -> EngineBuild:
    """Parse ``onnx_path`` (lowered), build an engine for ``target`` and write it to ``out_file``.

    The timing cache under ``timing_dir`` (one file per builder version and SM) is loaded before
    and saved after the build, under a lock, so concurrent builds share it.
    """
    builder_info = BUILDERS[target.backend]
    trt = import_builder(target.backend, f"--gpu {target.name}")
    log = _Logger(trt, say)
    builder = trt.Builder(log.logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # TensorRT 10; always on in 11 and RTX
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log.logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"{builder_info.product} could not parse the lowered graph: {errors}")
    net_stats = _finish_network(trt, network)
    net_stats["layers"] = network.num_layers

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if not builder_info.needs_gpu:
        config.num_compute_capabilities = 1
        config.set_compute_capability(_compute_capability(trt, target.sm), 0)
    shapes = _profile_shapes(network, profile)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)

    if builder_info.timing_cache:
        plan, build_s, timing = _build_with_timing_cache(builder, network, config, log, builder_info,
                                                         _timing_cache_file(timing_dir, target.backend,
                                                                            trt.__version__, target.sm))
    else:
        t = time.perf_counter()
        plan = builder.build_serialized_network(network, config)
        build_s = time.perf_counter() - t
        timing = {"used": False, "reason": f"{builder_info.product} does not time kernels at build time"}
    if plan is None:
        raise RuntimeError(f"{builder_info.product} failed to build the engine: " + "; ".join(log.messages))
    data = memoryview(plan)
    out_file.write_bytes(data)
    io = []
    for i in range(network.num_inputs):
        t_ = network.get_input(i)
        io.append({"name": t_.name, "mode": "input", "dtype": t_.dtype.name.lower(), "shape": list(t_.shape)})
    for i in range(network.num_outputs):
        t_ = network.get_output(i)
        io.append({"name": t_.name, "mode": "output", "dtype": t_.dtype.name.lower(), "shape": list(t_.shape)})
    return EngineBuild(
        plan_bytes=len(data), build_s=build_s,
        timing_cache=timing,
        network=net_stats, io=io,
        profiles=[{name: {"min": list(lo), "opt": list(opt), "max": list(hi)} for name, (lo, opt, hi) in
                   shapes.items()}])


def emit(model: ir.Model, out_dir: Path, target, profile: Profile, timing_dir: Path,
         say: Callable[[str], None]) -> tuple[dict, dict, dict]:
    """Lower ``model``, build the engine into ``out_dir/engine.plan``.

    Returns (manifest ``engine`` fields, manifest ``kv_cache`` fields, build details for
    build_info.json: timings, timing-cache use, network statistics).
    """
    trt = import_builder(target.backend, f"--gpu {target.name}")
    builder_info = BUILDERS[target.backend]
    t = time.perf_counter()
    lowered = trt_lowering.lower(model, profile.max_seq_len)
    lower_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="llmc-trt-") as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        t = time.perf_counter()
        ir.save(model, onnx_path, external_data="model.onnx.data")  # streams the weights
        save_s = time.perf_counter() - t
        say(f"      {builder_info.product} {trt.__version__}: build for sm_{target.sm.replace('.', '')}")
        result = build_engine(onnx_path, out_dir / ENGINE_FILE, target, profile, timing_dir, say)
    engine = {
        "backend": target.backend,
        "engine_file": ENGINE_FILE,
        "builder": {"product": builder_info.product, "module": builder_info.module, "version": trt.__version__},
        "sm": target.sm,
        "compute_capabilities": [target.sm],
        # RTX engines run on the compute capabilities they were built for; TensorRT engines on the GPU
        # model they were built on (no hardware-compatibility mode: it disables the fastest tactics).
        "hardware_compatibility_level": "none",
        "strongly_typed": True,
        "compute_dtype": "float16",
        "profiles": result.profiles,
        "limits": asdict(profile),
        "io": result.io,
        "inputs": [d["name"] for d in result.io if d["mode"] == "input"],
        "outputs": [d["name"] for d in result.io if d["mode"] == "output"],
        # present_* outputs alias their past_* inputs (bind one buffer to both).
        "aliased_outputs": {f"present_{n.removeprefix('past_')}": n for n in lowered.inputs if
                            n.startswith("past_")},
    }
    kv = {
        "layout": trt_lowering.KV_LAYOUT,
        "block_size": None,
        "max_slots": profile.max_batch_size,
        "max_seq_len": profile.max_seq_len,
        "dtype": lowered.kv_dtype,
        "num_layers": lowered.num_layers,
        "num_kv_heads": lowered.num_kv_heads,
        "head_size": lowered.head_size,
        "num_heads": lowered.num_heads,
        "shape": ["slots", lowered.num_kv_heads, profile.max_seq_len, lowered.head_size],
        "inputs": trt_lowering.KV_INPUT,
        "outputs": trt_lowering.KV_OUTPUT,
    }
    details = {"lower_s": round(lower_s, 3), "save_onnx_s": round(save_s, 3),
               "engine_build_s": round(result.build_s, 3), "engine_bytes": result.plan_bytes,
               "timing_cache": result.timing_cache,
               "network": {**result.network, **lowered.stats}}
    return engine, kv, details


def default_profile(max_batch_size: int | None, max_num_tokens: int | None, max_seq_len: int | None,
                    model_max_len: int | None) -> Profile:
    """The build's shape limits, filling unset ones: 16 sequences, 2048 tokens a step, and the model's
    context length capped at 8192 tokens (the KV slots are allocated at full length)."""
    seq = max_seq_len or min(model_max_len or 4096, 8192)
    prof = Profile(max_batch_size or 16, max_num_tokens or 2048, seq)
    for flag, value in (("--max-batch-size", prof.max_batch_size), ("--max-num-tokens", prof.max_num_tokens),
                        ("--max-seq-len", prof.max_seq_len)):
        if value < 1:
            raise LlmcError(f"{flag} {value}: must be at least 1")
    if prof.max_num_tokens < prof.max_batch_size:
        raise LlmcError(f"--max-num-tokens {prof.max_num_tokens} is below --max-batch-size {prof.max_batch_size}: "
                        "a decode step of a full batch needs one token per sequence")
    return prof
