"""Calibrate and, for AWQ/GPTQ, quantize every linear layer, one decoder layer at a time.

The result holds what the graph pass needs and nothing of full precision: INT4 weights (AWQ,
GPTQ), AWQ input scales and where they fold, activation and KV ranges (FP8, NVFP4).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.quant import awq, gptq, int4
from llmc.quant.calibration import LayerStats, LayerwiseCalibration
from llmc.quant.recipe import QuantRecipe

# AutoAWQ leaves Q and K unclipped: their errors pass through the softmax, where the linear output
# error is a poor proxy. We follow it.
_NO_CLIP = ("q_proj", "k_proj")
# AWQ and GPTQ calibrate with bfloat16 GEMMs (the forward; AWQ's Gram matrices read its inputs rounded to
# bfloat16 too): 3-4x float32's rate on AVX-512 BF16; the default model's int4-awq / int4-gptq KL and perplexity
# before and after are in benchmarks/results/quant_calibration_ab.json. GPTQ's Gram matrices read its inputs as
# they are (the norms' float32 outputs; the bfloat16 ones exactly): GPTQ factorises H, whose damping (1 % of its
# mean diagonal) is not far above what rounding its inputs to bfloat16 could move. Both are summed in float32
# (quant/gram.py).
ALGORITHM_COMPUTE = "bfloat16"
# Range collection (FP8, NVFP4 activations, the FP8 KV cache) runs the same bfloat16 forward: its GEMMs are all of
# its time (py-spy, 1B --gpu h100 --quant fp8: 91 % in Linear.forward), 4.2x float32's rate here (AMD EPYC, AVX-512
# BF16: 816 vs 194 GFLOP/s); an 8B model's ranges took 617 s of a 1372 s build in float32. A maximum read from
# bfloat16-rounded activations moves a scale by at most 2^-8 of itself; the reports before and after are in the
# issue 50 note (1B and 8B: KL and perplexity within their noise).
RANGE_COMPUTE = "bfloat16"


@dataclass
class LinearQuant:
    """One linear layer, by its parameter name. ``weights`` are its INT4 weights ``[N, K]``;
    ``input_scale`` (AWQ) divides its input, done by the op named in ``fold``: a norm weight's
    parameter name, ``"previous-linear"`` (already folded into the producing linear's weights), or
    None (an explicit ``Mul`` in the graph)."""

    weights: int4.Int4Weights | int4.SpilledInt4 | None = None
    input_scale: np.ndarray | None = None
    fold: str | None = None


@dataclass
class CalibrationResult:
    """``linears`` by parameter name; ``input_amax`` the largest input magnitude of each linear (by
    parameter name); ``kv_amax`` ``layer -> (key, value)`` largest magnitudes; ``decisions`` the
    per-layer report rows."""

    linears: dict[str, LinearQuant] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    kv_amax: dict[int, tuple[float, float]] = field(default_factory=dict)
    decisions: list[dict] = field(default_factory=list)
    num_tokens: int = 0
    layer_seconds: list[float] = field(default_factory=list)  # calibration time per decoder layer, then the head


def _short(group: tuple[str, ...]) -> str:
    """``q_proj/k_proj/v_proj`` for a group of parameter names."""
    return "/".join(name.removesuffix(".weight").rsplit(".", 1)[-1] for name in group)


def _up_of(group: tuple[str, ...], stats: LayerStats) -> str | None:
    """The up projection whose output rows feed ``group``'s input, for a gated MLP's down projection."""
    if len(group) != 1 or ".down_proj." not in group[0]:
        return None
    up = group[0].replace(".down_proj.", ".up_proj.")
    return up if up in stats.linears else None


def _awq_layer(stats: LayerStats, recipe: QuantRecipe, result: CalibrationResult,
               tick: Callable[[str], None] = lambda what: None) -> None:

    gs, sym = recipe.group_size, recipe.symmetric
    searches, blocks = {}, {}
    for group in stats.groups:
        s = stats.inputs[group]
        # The search's bfloat16 H from float32 quotients: the same values as rounding float64 ones (float64 holds
        # every float32 quotient's rounding exactly), without a K x K float64 temporary (512 MB at K = 8192), and
        # a panel at a time, without the float32 H either (bf16_upper_from_gram: the same bits).
        upper = awq.bf16_upper_from_gram(s.gram, s.rows)
        searches[group] = awq.search_scales(stats.stacked(group), s.abs_mean, None, gs, sym, upper=upper)
        del upper
        tick(f"{_short(group)} scales searched")
        # All the clip search reads of H, in float64 as before: the Gram's diagonal blocks over the row count.
        blocks[group] = awq.diagonal_blocks(s.gram, gs).astype(np.float64) / max(s.rows, 1)
    row_divisors: dict[str, np.ndarray] = {}
    folds: dict[tuple[str, ...], str | None] = {}
    for group, search in searches.items():
        norm = stats.producers.get(group)
        up = _up_of(group, stats)
        if norm is not None:
            folds[group] = norm
        elif up is not None:
            row_divisors[up] = search.scales
            folds[group] = "previous-linear"
        else:
            folds[group] = None
    for group, search in searches.items():
        for name in group:
            w = stats.weight(name)
            if name in row_divisors:  # this layer's output feeds a scaled input: divide its rows
                w = w / row_divisors[name][:, None]
            clip = not any(t in name for t in _NO_CLIP)
            q = awq.quantize(w, search.scales, None, gs, sym, clip=clip, blocks=blocks[group])
            result.linears[name] = LinearQuant(q, search.scales, folds[group])
        result.decisions.append({"linears": list(group), "algorithm": "awq", "alpha": search.alpha,
                                 "fold": folds[group] or "mul", "output_mse_rtn": search.loss_rtn,
                                 "output_mse_scaled": search.loss})
        tick(f"{_short(group)} clipped and quantized")


def _gptq_layer(stats: LayerStats, recipe: QuantRecipe, result: CalibrationResult,
                tick: Callable[[str], None] = lambda what: None) -> None:
    import torch

    for group in stats.groups:
        s = stats.inputs[group]
        h = s.hessian_as(np.float32)  # GPTQ factorises it in float32
        # the report's output errors (3-4x float32's rate, ~3e-4 relative), from the Gram a panel at a time
        upper = awq.bf16_upper_from_gram(s.gram, s.rows)
        weights = [stats.weight(name) for name in group]
        # GPTQ treats rows independently: the group's linears, stacked, share one factorisation and one
        # pass over the columns (Q/K/V, gate/up: a third and a half of the column loops).
        stacked = gptq.quantize(np.concatenate(weights), h, recipe.group_size, recipe.symmetric)
        start = 0
        for name, w in zip(group, weights, strict=True):
            q = int4.rows(stacked, start, start + w.shape[0])
            start += w.shape[0]
            w_t = torch.from_numpy(w)
            rtn = int4.torch_rtn_dequantized(w_t, recipe.group_size, recipe.symmetric)
            deq = q.dequantize()
            result.linears[name] = LinearQuant(q)
            result.decisions.append({"linears": [name], "algorithm": "gptq",
                                     "output_mse_rtn": awq.bf16_output_error(w_t - rtn, upper),
                                     "output_mse": awq.bf16_output_error(w_t - torch.from_numpy(deq), upper)})
            # Later layers calibrate on this layer's quantized output, as in the GPTQ paper.
            stats.set_weight(name, deq)
        tick(f"{_short(group)} quantized")


def collect(config, param_reader: Callable[[object], Callable[[str], np.ndarray]], samples: np.ndarray,
            recipe: QuantRecipe, progress: Callable[[str], None] | None = None, head: bool = True,
            compute: str | None = None, device: str = "cpu", spill_dir=None) -> CalibrationResult:
    """Run calibration over ``samples [n, seq_len]`` and apply the recipe's algorithm layer by layer
    (``param_reader`` as in :class:`~llmc.quant.calibration.LayerwiseCalibration`). ``head``: calibrate the LM
    head too (False when the build keeps it out of the format, e.g. INT8 beside INT4 on the CPU). ``compute``:
    the calibration forward's and Gram matrices' GEMM dtype; default :data:`ALGORITHM_COMPUTE` for AWQ/GPTQ,
    :data:`RANGE_COMPUTE` for range collection (FP8, NVFP4, the FP8 KV cache: no Gram matrices, only maxima).
    ``device``: where the calibration forward and its statistics run (``"cpu"`` or ``"cuda"``); AWQ and GPTQ run on
    the CPU.
    ``spill_dir``: a directory where each layer's INT4 weights go once the layer is done (None: kept in memory), so
    that calibrating a model holds one layer's weights, not the model's."""
    say = progress or (lambda msg: None)
    algorithm = recipe.format.algorithm if recipe.format is not None and recipe.format.family == "int4" else None
    result = CalibrationResult(num_tokens=int(samples.size))
    searching = algorithm in ("awq", "gptq")
    run = LayerwiseCalibration(config, param_reader, samples,
                               compute=compute or (ALGORITHM_COMPUTE if searching else RANGE_COMPUTE), gram=searching,
                               gram_compute="float32" if algorithm == "gptq" else None, device=device,
                               abs_sums=algorithm == "awq")

    def consume(stats: LayerStats, tick: Callable[[str], None] = lambda what: None) -> None:
        for group in stats.groups:
            for name in group:
                result.input_amax[name] = stats.inputs[group].amax
        if stats.kv_amax is not None:
            layer = stats.attention_layer if stats.attention_layer is not None else stats.index
            result.kv_amax[layer] = stats.kv_amax
        if algorithm == "awq":
            _awq_layer(stats, recipe, result, tick)
        elif algorithm == "gptq":
            _gptq_layer(stats, recipe, result, tick)

    from llmc.quant.ort_copies import release_freed_memory

    # The trace and the passes leave freed memory in malloc's arenas; calibration's peak (AWQ's down projection:
    # its Gram, the bfloat16 H, the layer's float32 weights) sits on top of whatever stays resident.
    release_freed_memory()
    total = len(run.blocks)
    start = last = time.perf_counter()
    for stats in run.layers():
        def tick(what: str, index: int = stats.index, began: float = last) -> None:
            # Within a slow layer (an 8B model's take a minute or more here), a line per step once the layer has
            # run STEP_PROGRESS_S: the per-layer line alone would leave long silences. (At 5 s a 1B layer printed
            # six lines every 10 s on 2 cores.)
            into = time.perf_counter() - began
            if into >= STEP_PROGRESS_S:
                say(f"        layer {index + 1}/{total}: {what}, {into:.0f}s into the layer")

        consume(stats, tick)
        if spill_dir is not None:
            for name, lq in result.linears.items():
                if isinstance(lq.weights, int4.Int4Weights):
                    lq.weights = int4.spill(lq.weights, Path(spill_dir) / f"{len(result.layer_seconds)}-{name}.npz")
        release_freed_memory()  # the layer's statistics and searches, freed in the arenas of torch's threads
        now = time.perf_counter()
        result.layer_seconds.append(now - last)
        last = now
        say(progress_line(stats.index + 1, total, now - start, algorithm or "ranges"))
    if head:
        consume(run.head())
        run.release_head()
    result.layer_seconds.append(time.perf_counter() - last)
    return result


STEP_PROGRESS_S = 15.0  # a layer's steps say when they finish once the layer has taken this long (s)


def progress_line(done: int, total: int, elapsed: float, what: str, width: int = 20) -> str:
    """``[#####...............] layer 4/16 (awq) 12.5 s/layer, 37s elapsed, ETA 2m30s, 1.2 GB resident``: one line
    per finished layer (a build's stderr is often a log file, where carriage-return redraws would pile up)."""
    from llmc.memory import rss_gb

    filled = round(width * done / total)
    rate = elapsed / done
    return (f"      [{'#' * filled}{'.' * (width - filled)}] layer {done}/{total} ({what}) {rate:.1f} s/layer, "
            f"{_duration(elapsed)} elapsed, ETA {_duration(rate * (total - done))}, {rss_gb():.1f} GB resident")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
