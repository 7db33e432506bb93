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

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from llmc.errors import LlmcError
from llmc.passes.base import GraphPass
from llmc.quant import evaluate
from llmc.quant.recipe import QuantRecipe, resolve_calib_device

PASS_NAME = "quantize"
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
                 form: str = "cpu", *, params: ParamReader | None = None) -> None:
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
        # The CPU form stores the LM head apart from the INT4 format (quant.graph: INT8 or full precision) unless
        # --lm-head int4: its AWQ search (a 1B model's: ~30 s) would be thrown away.
        head = not (r.format is not None and r.format.family == "int4" and self.form == "cpu" and r.lm_head != "int4")
        return collect(config, self.params, samples, r, progress=self.say, head=head, device=device)

    def _run(self, model: ir.Model) -> dict[str, int]:
        from llmc.quant.graph import quantize_model

        self.reference = model.clone()
        t = time.perf_counter()
        if self.recipe.needs_calibration():
            self.calibration = self._calibrate()
            # Per-layer times go to build_info.json's timings (unsealed: report.json depends on the inputs only).
            *layers, head = self.calibration.layer_seconds
            self.timings.update({f"calibrate_layer_{i}": v for i, v in enumerate(layers)})
            self.timings["calibrate_head"] = head
        self.timings["calibrate"] = time.perf_counter() - t
        self.stats = quantize_model(model, self.recipe, self.calibration, self.recipe.int4_accuracy_level,
                                    form=self.form)
        return {k: v for k, v in self.stats.items() if isinstance(v, int)}

    def evaluate(self, engine_dir: Path, emit_reference: Callable[[ir.Model, Path], None],
                 reference_cache: Path | None = None, reference_key: str = "",
                 precision: evaluate.Precision | None = None, device: str | None = None,
                 scored: str | None = None) -> evaluate.Accuracy:
        """Score the engine at ``engine_dir`` against the reference graph, emitted by ``emit_reference(model,
        dir)`` into a temporary loadable engine (``dir`` exists and is empty) when its scores are not in
        ``reference_cache`` (a directory; None: no cache) under ``reference_key`` (what determines the reference:
        the checkpoint's digest and llmc's sources). Scoring stops at ``precision`` (default :class:`Precision`).
        ``device``: where a CUDA engine at ``engine_dir`` runs (None: a CPU engine). ``scored``: what the figures
        are of, for the report (default: the engine at ``engine_dir``, named from its manifest)."""
        from llmc.runtime import Engine

        if self.reference is None:
            raise RuntimeError("the quantize pass has not run")
        t = time.perf_counter()
        self.say(f"      evaluate {self.name} against the unquantized graph on held-out text")
        windows = evaluate.heldout_windows(engine_dir / "tokenizer.json", EVAL_WINDOW, EVAL_TOKENS)
        with tempfile.TemporaryDirectory(prefix="llmc-reference-") as tmp:
            reference = ReferenceScores(windows, reference_cache, reference_key,
                                        lambda: _load_reference(self.reference, Path(tmp), emit_reference))
            quantized = Engine.load(engine_dir, verify=False, kv_cache_tokens=2 * EVAL_WINDOW,
                                    **({"device": device, "cuda_graphs": False} if device else {}))
            if precision is None:
                n = self.recipe.eval_tokens
                # A fixed count: no early stop before it.
                precision = evaluate.Precision() if n is None else evaluate.Precision(n, n, 0.0)
            self.accuracy = evaluate.compare(reference, quantized, windows, progress=self.say, precision=precision)
            self.accuracy.reference_cached = reference.engine is None
            self.accuracy.scored = scored or _scored_engine(quantized, device)
            reference.save()
            self.timings["evaluate_reference_load"] = reference.load_seconds
        self.reference = None
        self.timings["evaluate"] = time.perf_counter() - t
        self.say(f"      {self.accuracy.summary()}"
                 + (" (unquantized scores from the cache)" if self.accuracy.reference_cached else ""))
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
                "seq_len": r.calib_seq_len, "seed": r.seed, "tokens": self.calibration.num_tokens,
                "device": self.calib_device}
            out["quantization"]["layers"] = _rounded(self.calibration.decisions)
            if self.calibration.kv_amax and r.kv_cache_dtype:
                out["quantization"]["kv_cache_amax"] = {str(k): [float(f"{a:.6g}") for a in v]
                                                        for k, v in sorted(self.calibration.kv_amax.items())}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy.to_json()
        return out


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def _scored_engine(engine, device: str | None) -> str:
    """What the accuracy figures scored, named from the engine's manifest."""
    if device is None:
        return f"the engine ({engine.manifest['engine'].get('backend', 'onnxruntime')}, on the CPU)"
    dtype = engine.manifest["engine"].get("dtype", "?")
    where = "GPU" if device == "cuda" else device.upper()
    return f"the CUDA engine itself ({dtype}, on the {where})"


def _load_reference(model: ir.Model, where: Path, emit_reference: Callable[[ir.Model, Path], None]):
    from llmc.runtime import Engine

    emit_reference(model, where)
    return Engine.load(where, verify=False, kv_cache_tokens=2 * EVAL_WINDOW)


class ReferenceScores:
    """The unquantized engine's log-probabilities of each held-out window, from the cache when a build of the same
    checkpoint (any recipe) scored them before, else from the engine ``load()`` returns (emitted only then).

    Cache file: ``<dir>/<sha256 of key and windows>.npz`` holding float32 ``logp [tokens, vocab]`` and the
    window ``lengths``; written whole, atomically, when this build scored more windows than it held, unless
    larger than :data:`REFERENCE_CACHE_LIMIT` bytes."""

    def __init__(self, windows: list[list[int]], directory: Path | None, key: str, load: Callable[[], object]):
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
        logp = evaluate.log_softmax(self.engine.score(ids))
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
