"""Quantization as a build stage: the ``quantize`` graph pass (with its calibration), the unquantized
reference graph it keeps, and the accuracy evaluation of the finished engine against it.

The pass runs after the fusions (and before the final dead-code elimination). Before rewriting it
clones the graph (``onnx_ir.Model.clone`` shares the lazy weight tensors, so the copy costs no
weight memory); the build emits that clone into a temporary engine and scores both engines on
held-out text.

``--verify-passes`` and quantization: the verifier's random-input, 1e-5 check cannot apply to a
pass that changes numerics on purpose, so for ``quantize`` it records the logit change without
judging it and re-bases on the quantized graph (later passes are checked strictly against it).
The accuracy report on real held-out text is the quantization-aware check.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from llmc.passes.base import GraphPass
from llmc.quant import evaluate
from llmc.quant.recipe import QuantRecipe

PASS_NAME = "quantize"
EVAL_WINDOW = 256
EVAL_TOKENS = 16384


def _param_reader(checkpoint):
    """A function of the transformers model giving ``name -> float32 array`` read from ``checkpoint``,
    with the frontend's own name mapping (renamed keys, tied embeddings). A parameter that transformers
    builds from several checkpoint tensors (per-expert MoE weights merged into one ``[E, N, K]`` tensor)
    is assembled on demand by the same weight converter transformers applies when loading, from only
    that parameter's source tensors: calibration still reads one layer at a time."""
    import numpy as np

    from llmc.compiler.checkpoint import read_tensor
    from llmc.compiler.frontend import _model_keys, _source_entry

    def for_model(model):
        tensors, needs_converter = _model_keys(checkpoint, model)
        merged = _converted_sources(checkpoint, model) if needs_converter else {}

        def read(name: str) -> np.ndarray:
            entry = _source_entry(tensors, name, model)
            if entry is not None:
                return np.asarray(read_tensor(entry), np.float32)
            if name in merged:
                return _convert(name, *merged[name], model)
            raise RuntimeError(f"calibration: no checkpoint tensor for parameter {name!r}")

        return read

    return for_model


def _converted_sources(checkpoint, model) -> dict[str, tuple[object, dict[str, list]]]:
    """``parameter name -> (WeightConverter, {source pattern: [TensorEntry, ...]})`` for the parameters
    transformers assembles from several checkpoint tensors, the entries in transformers' loading order."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(model.state_dict())
    out: dict[str, tuple[object, dict[str, list]]] = {}
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        for converter in converters:
            target, pattern = rename_source_key(key, renamings, [converter], model.base_model_prefix, meta)
            if pattern is not None:
                out.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(checkpoint.tensors[key])
                break
    return out


def _convert(name: str, converter, sources: dict[str, list], model):
    """One merged parameter: the converter's operations (e.g. stack the experts, concatenate gate and up)
    applied to its source tensors, as float32 numpy."""
    import numpy as np
    import torch

    from llmc.compiler.checkpoint import read_tensor

    tensors = {pattern: [torch.from_numpy(np.array(read_tensor(e), np.float32, copy=True)) for e in entries]
               for pattern, entries in sources.items()}
    for op in converter.operations:
        tensors = op.convert(tensors, source_patterns=converter.source_patterns,
                             target_patterns=converter.target_patterns, full_layer_name=name, model=model,
                             config=model.config, missing_keys=None)
    if len(tensors) != 1:
        raise RuntimeError(f"calibration: transformers' converter for {name!r} gives {len(tensors)} tensors "
                           f"({', '.join(tensors)}); llmc handles converters that give one")
    (value,) = tensors.values()
    return value.detach().float().numpy()


class QuantStage:
    """One build's quantization. ``warnings`` are shown to the user (CPU emulation)."""

    def __init__(self, checkpoint, recipe: QuantRecipe, progress: Callable[[str], None] | None = None,
                 form: str = "cpu") -> None:
        self.checkpoint = checkpoint
        self.recipe = recipe
        self.form = form  # quantize_model's form: "cpu" (ONNX Runtime kernels) or "qdq" (TensorRT)
        self.say = progress or (lambda msg: None)
        self.reference: ir.Model | None = None
        self.calibration = None
        self.stats: dict = {}
        self.timings: dict[str, float] = {}
        self.accuracy: evaluate.Accuracy | None = None

    @property
    def graph_pass(self) -> GraphPass:
        return GraphPass(PASS_NAME, self._run, f"quantize for {self.name} (changes numerics on purpose)",
                         fusion=False)

    @property
    def name(self) -> str:
        r = self.recipe
        parts = [] if r.quant == "none" else [r.quant + (f" g{r.group_size}" if r.format.family == "int4" else "")]
        if r.kv_cache_dtype:
            parts.append(f"{r.kv_cache_dtype} KV cache")
        return " + ".join(parts)

    def _calibrate(self):
        from transformers import AutoConfig

        from llmc.quant import calibration
        from llmc.quant.collect import collect

        r = self.recipe
        config = AutoConfig.from_pretrained(self.checkpoint.path, local_files_only=True)
        seq_len = min(r.calib_seq_len, int(getattr(config, "max_position_embeddings", r.calib_seq_len)))
        docs, eos = calibration.tokenize(self.checkpoint.path / "tokenizer.json", calibration.load_texts(r.calib_data))
        samples = calibration.sample_sequences(docs, r.calib_samples, seq_len, r.seed, separator=eos)
        self.say(f"      calibrate on {samples.shape[0]} x {samples.shape[1]} tokens "
                 f"({r.calib_data or 'built-in pydoc text'}, seed {r.seed})")
        return collect(config, _param_reader(self.checkpoint), samples, r, progress=self.say)

    def _run(self, model: ir.Model) -> dict[str, int]:
        from llmc.quant.graph import quantize_model

        self.reference = model.clone()
        t = time.perf_counter()
        if self.recipe.needs_calibration():
            self.calibration = self._calibrate()
        self.timings["calibrate"] = time.perf_counter() - t
        self.stats = quantize_model(model, self.recipe, self.calibration, self.recipe.int4_accuracy_level,
                                    form=self.form)
        return {k: v for k, v in self.stats.items() if isinstance(v, int)}

    def evaluate(self, engine_dir: Path, emit_reference: Callable[[ir.Model, Path], None]) -> evaluate.Accuracy:
        """Score the engine at ``engine_dir`` against the reference graph, emitted by ``emit_reference(model,
        dir)`` into a temporary loadable engine (``dir`` exists and is empty)."""
        from llmc.runtime import Engine

        if self.reference is None:
            raise RuntimeError("the quantize pass has not run")
        t = time.perf_counter()
        self.say(f"      evaluate {self.name} against the unquantized graph on held-out text")
        with tempfile.TemporaryDirectory(prefix="llmc-reference-") as tmp:
            emit_reference(self.reference, Path(tmp))
            reference = Engine.load(tmp, verify=False, kv_cache_tokens=2 * EVAL_WINDOW)
            quantized = Engine.load(engine_dir, verify=False, kv_cache_tokens=2 * EVAL_WINDOW)
            windows = evaluate.heldout_windows(engine_dir / "tokenizer.json", EVAL_WINDOW, EVAL_TOKENS)
            self.accuracy = evaluate.compare(reference, quantized, windows)
        self.reference = None
        self.timings["evaluate"] = time.perf_counter() - t
        self.say(f"      {self.accuracy.summary()}")
        return self.accuracy

    def report(self) -> dict:
        """The ``report.json`` entries: ``quantization`` (recipe, per-layer decisions) and ``accuracy``."""
        r = self.recipe
        out: dict = {"quantization": {
            "format": r.quant, "group_size": r.group_size if r.format and r.format.family == "int4" else None,
            "symmetric": r.symmetric, "kv_cache_dtype": r.kv_cache_dtype, "embeddings": r.embeddings,
            "int4_accuracy_level": r.int4_accuracy_level,
            "int4_kernel": r.int4_kernel,
            "algorithm": r.format.algorithm if r.format else None,
            "emulated_on_cpu": bool((r.format and not r.format.cpu_native) or r.kv_cache_dtype == "fp8"),
            "graph": {k: v for k, v in self.stats.items() if isinstance(v, int)},
        }}
        if self.calibration is not None:
            out["quantization"]["calibration"] = {
                "data": r.calib_data or "built-in: pydoc_data.topics train split", "samples": r.calib_samples,
                "seq_len": r.calib_seq_len, "seed": r.seed, "tokens": self.calibration.num_tokens}
            out["quantization"]["layers"] = _rounded(self.calibration.decisions)
            if self.calibration.kv_amax and r.kv_cache_dtype:
                out["quantization"]["kv_cache_amax"] = {str(k): [float(f"{a:.6g}") for a in v]
                                                        for k, v in sorted(self.calibration.kv_amax.items())}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy.to_json()
        return out


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()} for row in rows]
