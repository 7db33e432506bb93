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

import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from llmc import scratch
from llmc.errors import LlmcError
from llmc.passes.base import GraphPass
from llmc.quant import evaluate, layerwise
from llmc.quant.recipe import QuantRecipe, resolve_calib_device

PASS_NAME = "quantize"
SPILL_PREFIX = "llmc-calibration-"  # INT4 weights waiting on disk for the graph pass
EVAL_WINDOW = 256
EVAL_TOKENS = 65536  # held-out windows read; how many are scored: QuantRecipe.eval_tokens / evaluate.Precision


# For calibration: a function of the transformers model giving ``name -> float32 weight``, read from the
# checkpoint. The compiler owns the checkpoint-to-weight binding (llmc.compiler.binding.param_reader) and
# hands it in, so quantization never imports the layer above it.
ParamReader = Callable[[object], Callable[[str], "np.ndarray"]]


class QuantStage:
    """One build's quantization. ``warnings`` are shown to the user (CPU emulation).

    ``checkpoint`` needs a ``path`` (config.json, tokenizer.json); ``params`` is required when the recipe
    calibrates."""

    def __init__(self, checkpoint, recipe: QuantRecipe, progress: Callable[[str], None] | None = None,
                 form: str = "cpu", *, params: ParamReader | None = None, memory=None) -> None:
        if not (Path(checkpoint.path) / "tokenizer.json").is_file():
            # Calibration and the accuracy check both run on text.
            raise LlmcError(f"{checkpoint.path}: no tokenizer.json; quantized builds (--quant, --kv-cache-dtype) "
                            "calibrate and measure accuracy on text: add the model's tokenizer files or build "
                            "without quantization")
        self.checkpoint = checkpoint
        self.params = params
        self.recipe = recipe
        self.form = form  # quantize_model's form: "cpu" (ONNX Runtime kernels) or "qdq" (TensorRT)
        self.say = progress or (lambda msg: None)
        self.reference: ir.Model | None = None
        self.calibration = None
        self.calib_device: str | None = None  # where calibration ran, once it has
        self.stats: dict = {}
        self.timings: dict[str, float] = {}
        self.accuracy: evaluate.Accuracy | None = None
        self.image_accuracy: dict | None = None  # image prompts of a vision-language build (quant/image_prompts.py)
        # llmc.memory.StagePeaks of the build (calibration and evaluation get peaks of their own), or None.
        self.memory = memory

    def _sub(self, name: str | None) -> None:
        if self.memory is not None:
            if name is None:
                self.memory.stop()
            else:
                self.memory.start(name)

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
        # The build resolved "auto" already (before its cache key); a stage used on its own resolves it the same way.
        self.calib_device = device = resolve_calib_device(r).calib_device
        self.say(f"      calibrate on {samples.shape[0]} x {samples.shape[1]} tokens "
                 f"({r.calib_data or 'built-in pydoc text'}, seed {r.seed}) on the {device.upper()}")
        if self.params is None:
            raise RuntimeError("QuantStage(params=...) is needed to calibrate")
        # The CPU form stores the LM head apart from the INT4 format (passes/quantize.py: INT8 or full precision) unless
        # --lm-head int4: its AWQ search (a 1B model's: ~30 s) would be thrown away.
        head = not (r.format is not None and r.format.family == "int4" and self.form == "cpu" and r.lm_head != "int4")
        # INT4 weights wait on disk for the graph pass, a layer at a time (removed with the stage).
        self._spill = tempfile.mkdtemp(prefix=SPILL_PREFIX)
        scratch.mark(Path(self._spill), SPILL_PREFIX)  # a killed build's spill is removed by the next one
        weakref.finalize(self, shutil.rmtree, self._spill, True)
        return collect(config, self.params, samples, r, progress=self.say, head=head, device=device,
                       spill_dir=self._spill)

    def _run(self, model: ir.Model) -> dict[str, int]:
        from llmc.passes.quantize import quantize_model

        self.reference = model.clone()
        t = time.perf_counter()
        if self.recipe.needs_calibration():
            self._sub("calibrate")
            try:
                self.calibration = self._calibrate()
            finally:
                self._sub(None)
            # Per-layer times go to build_info.json's timings (unsealed: report.json depends on the inputs only).
            *layers, head = self.calibration.layer_seconds
            self.timings.update({f"calibrate_layer_{i}": v for i, v in enumerate(layers)})
            self.timings["calibrate_head"] = head
        self.timings["calibrate"] = time.perf_counter() - t
        self.stats = quantize_model(model, self.recipe, self.calibration, self.recipe.int4_accuracy_level,
                                    form=self.form)
        return {k: v for k, v in self.stats.items() if isinstance(v, int)}

    def evaluate(self, engine_dir: Path, lower: Callable[[ir.Model], object], kv: layerwise.KVShape,
                 custom_ops: str, *, quantized_graph: ir.Model | None = None,
                 quantized_kv: layerwise.KVShape | None = None,
                 reference_cache: Path | None = None, reference_key: str = "",
                 precision: evaluate.Precision | None = None, device: str | None = None,
                 scored: str | None = None, round_tokens: int | None = None) -> evaluate.Accuracy:
        """Score the quantized engine against the unquantized graph on held-out text, one layer at a time
        (llmc.quant.layerwise: the memory of a layer, not of the model).

        The reference is the graph the quantize pass kept, made what ONNX Runtime runs by ``lower(model)`` (the CPU
        backend's lowering and fusions, in place), with the KV cache ``kv`` and the custom-op library
        ``custom_ops``; its scores come from ``reference_cache`` (a directory; None: no cache) under
        ``reference_key`` (the checkpoint's digest and llmc's sources) when a build scored them before. The
        quantized side is ``quantized_graph`` (lowered already; its cache ``quantized_kv``) where given, else the
        CPU engine at ``engine_dir`` (its model file, memory-mapped), or with ``device`` the CUDA engine there, run
        whole on that device.
        ``engine_dir`` holds the tokenizer either way. Scoring stops at ``precision`` (default :class:`Precision`);
        windows go through the layers in rounds of at most ``round_tokens`` tokens (default: to the precision
        rule's first check, then to its limit). ``scored``: what the figures are of, for the report."""
        if self.reference is None:
            raise RuntimeError("the quantize pass has not run")
        t = time.perf_counter()
        self.say(f"      evaluate {self.name} against the unquantized graph on held-out text, layer by layer")
        windows = evaluate.heldout_windows(engine_dir / "tokenizer.json", EVAL_WINDOW, EVAL_TOKENS)
        if precision is None:
            n = self.recipe.eval_tokens
            # A fixed count: no early stop before it.
            precision = evaluate.Precision() if n is None else evaluate.Precision(n, n, 0.0)
        plan = evaluate.rounds(windows, precision, round_tokens)

        def reference_scorer(kv=kv, custom_ops=custom_ops):
            lower(self.reference)
            return layerwise.LayerwiseScorer(self.reference, custom_ops, kv, "unquantized", self.say)

        reference = ReferenceScores(windows, reference_cache, reference_key, lambda: _Rounds(reference_scorer(),
                                                                                             windows, plan))
        if device is not None:
            from llmc.runtime import Engine

            engine = Engine.load(engine_dir, verify=False, kv_cache_tokens=2 * EVAL_WINDOW, device=device,
                                 cuda_graphs=False)
            quantized = _WholeEngine(engine)
            what = scored or _scored_engine(engine.manifest, device)
        else:
            if quantized_graph is None:
                quantized_graph, kv, custom_ops = _engine_graph(engine_dir)
                what = scored or _scored_engine(json.loads((engine_dir / "manifest.json").read_text()), None)
            else:
                what = scored or "the engine's quantized graph (onnxruntime, on the CPU)"
                kv = quantized_kv or kv
            quantized = _Rounds(layerwise.LayerwiseScorer(quantized_graph, custom_ops, kv, "quantized", self.say),
                                windows, plan)
        self._sub("evaluate")
        try:
            self.accuracy = evaluate.compare(reference, quantized, windows, progress=self.say, precision=precision)
        finally:
            self._sub(None)
        self.accuracy.reference_cached = reference.engine is None
        self.accuracy.scored = what
        reference.save()
        if device is None:  # a vision-language build: image prompts too (its CUDA engines take no images yet)
            self._evaluate_images(engine_dir, windows, reference, reference_scorer, quantized)
        self.timings["evaluate_reference_load"] = reference.load_seconds
        for side, scorer in (("reference", getattr(reference.engine, "scorer", None)),
                             ("quantized", getattr(quantized, "scorer", None))):
            if scorer is not None:
                self.timings[f"evaluate_{side}_sessions"] = scorer.session_seconds
                self.timings[f"evaluate_{side}_run"] = scorer.run_seconds
        self.reference = None
        self.timings["evaluate"] = time.perf_counter() - t
        self.say(f"      {self.accuracy.summary()}"
                 + (" (unquantized scores from the cache)" if self.accuracy.reference_cached else ""))
        return self.accuracy

    def _evaluate_images(self, engine_dir: Path, windows: list[list[int]], reference, reference_scorer,
                         quantized) -> None:
        """The image prompts' KL and top-1 agreement (llmc.quant.image_prompts), for an engine that takes images."""
        from llmc.quant import image_prompts

        t = time.perf_counter()
        manifest = json.loads((engine_dir / "manifest.json").read_text())
        prompts = image_prompts.image_windows(engine_dir, manifest, windows)
        if prompts is None:
            return
        self.say(f"      evaluate {self.name} on {len(prompts.windows)} image prompts")
        ref = reference.engine.scorer if reference.engine is not None else reference_scorer()
        self.image_accuracy = image_prompts.compare_images(prompts, ref, quantized.scorer)
        self.timings["evaluate_images"] = time.perf_counter() - t
        self.say(f"      image prompts: KL {self.image_accuracy['kl_mean']:.4f}, top-1 agreement "
                 f"{100 * self.image_accuracy['top1_agreement']:.1f}%")

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
        if self.calibration is not None and self.calib_device is not None:  # (not: weights handed in, uncalibrated)
            out["quantization"]["calibration"] = {
                "data": r.calib_data or "built-in: pydoc_data.topics train split", "samples": r.calib_samples,
                "seq_len": r.calib_seq_len, "seed": r.seed, "tokens": self.calibration.num_tokens,
                "device": self.calib_device}
            out["quantization"]["layers"] = _rounded(self.calibration.decisions)
            if self.calibration.kv_amax and r.kv_cache_dtype:
                out["quantization"]["kv_cache_amax"] = {str(k): [float(f"{a:.6g}") for a in v]
                                                        for k, v in sorted(self.calibration.kv_amax.items())}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy.to_json()
        if self.image_accuracy is not None:
            out["accuracy_images"] = self.image_accuracy
        return out


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def _scored_engine(manifest: dict, device: str | None) -> str:
    """What the accuracy figures scored, named from the engine's manifest."""
    if device is None:
        return f"the engine ({manifest['engine'].get('backend', 'onnxruntime')}, on the CPU)"
    dtype = manifest["engine"].get("dtype", "?")
    where = "GPU" if device == "cuda" else device.upper()
    return f"the CUDA engine itself ({dtype}, on the {where})"


def _engine_graph(engine_dir: Path) -> tuple[ir.Model, layerwise.KVShape, str]:
    """A CPU engine's graph (weights memory-mapped from its files, read a stage at a time), KV layout and
    custom-op library, from its manifest."""
    from llmc.runtime.workers.ort.session import custom_ops_of

    manifest = json.loads((engine_dir / "manifest.json").read_text())
    kv = manifest["kv_cache"]
    shape = layerwise.KVShape(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv["block_size"], kv["dtype"],
                              kv.get("layers"), manifest.get("state_cache"))
    return ir.load(engine_dir / manifest["engine"]["model_file"]), shape, custom_ops_of(manifest)


class _WholeEngine:
    """``(index, ids) -> logits`` from an engine run whole (a CUDA engine on its device)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, index: int, ids: list[int]) -> np.ndarray:
        return self.engine.score(ids)


class _Rounds:
    """``(index, ids) -> logits`` from a :class:`~llmc.quant.layerwise.LayerwiseScorer`: asked for window ``index``
    it scores the round of windows that holds it (``plan``: each round's end), all of them through every layer,
    and hands each window's logits out once."""

    def __init__(self, scorer: layerwise.LayerwiseScorer, windows: list[list[int]], plan: list[int]) -> None:
        self.scorer, self.windows, self.plan = scorer, windows, plan
        self.ready: dict[int, np.ndarray] = {}
        self.done = 0  # windows scored so far

    def __call__(self, index: int, ids: list[int]) -> np.ndarray:
        if index not in self.ready:
            if index < self.done:
                raise RuntimeError(f"window {index} was scored and handed out already")
            end = next((e for e in self.plan if e > index), len(self.windows))
            for i, logits in enumerate(self.scorer.run(self.windows[self.done:end]), self.done):
                self.ready[i] = logits
            self.done = end
        return self.ready.pop(index)


class ReferenceScores:
    """The unquantized graph's log-probabilities of each held-out window, from the cache when a build of the same
    checkpoint (any recipe) scored them before, else from the scorer ``load()`` returns (``(index, ids) ->
    logits``; made only then).

    Cache file: ``<dir>/<sha256 of key and windows>.npz`` holding float32 ``logp [tokens, vocab]`` and the
    window ``lengths``; written whole, atomically, when this build scored more windows than it held, unless
    larger than :data:`REFERENCE_CACHE_LIMIT` bytes."""

    def __init__(self, windows: list[list[int]], directory: Path | None, key: str,
                 load: Callable[[], Callable[[int, list[int]], np.ndarray]]):
        import hashlib
        import json

        self.windows = windows
        self.load = load
        self.engine = None
        self.load_seconds = 0.0
        self.scores: list[np.ndarray] = []
        self.path = None
        if directory is not None and key:
            digest = hashlib.sha256(json.dumps([key, windows]).encode()).hexdigest()[:32]
            self.path = Path(directory) / f"{digest}.npz"
            self.scores = self._read()
        self.cached = len(self.scores)

    def _read(self) -> list[np.ndarray]:
        try:
            with np.load(self.path) as data:
                logp, lengths = data["logp"], data["lengths"]
        except (OSError, ValueError, KeyError):  # absent or damaged: score again (and rewrite it)
            return []
        if lengths.sum() != len(logp) or any(n != len(w) for n, w in zip(lengths, self.windows, strict=False)):
            return []
        return np.split(logp, np.cumsum(lengths)[:-1])

    def __call__(self, index: int, ids: list[int]) -> np.ndarray:
        if index < len(self.scores):
            return self.scores[index]
        if self.engine is None:
            t = time.perf_counter()
            self.engine = self.load()
            self.load_seconds = time.perf_counter() - t
        logp = evaluate.log_softmax(self.engine(index, ids))
        self.scores.append(logp)
        return logp

    def save(self) -> None:
        if self.path is None or len(self.scores) <= self.cached:
            return
        logp = np.concatenate(self.scores)
        if logp.nbytes > REFERENCE_CACHE_LIMIT:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp.npz")
        try:
            np.savez(tmp, logp=logp, lengths=np.asarray([len(x) for x in self.scores], np.int64))
            os.replace(tmp, self.path)
        except OSError:  # a full or read-only cache costs the next build a reference run, not this build
            tmp.unlink(missing_ok=True)


# A 1B model with an 8192-token vocabulary, 16384 tokens: 512 MiB.
REFERENCE_CACHE_LIMIT = 1 << 30
