"""How much memory a build will need, from the checkpoint's index alone (no weights read), so that ``--max-memory``
refuses a build that cannot fit before any work, and sizes what it can.

A build holds one decoder layer at a time (the traced graph's weights are lazy; calibration and the accuracy report
go layer by layer), so its peak is the toolchain's own footprint plus the larger of

- scoring: the largest stage's weights in float32, twice (the arrays and ONNX Runtime's pre-packed copy), the
  activations a round of windows keeps between layers, and the working activations of one step of windows run
  together (llmc.quant.layerwise's groups: at most ``GROUP_TOKENS`` tokens, the MLP's widest values);
- calibration (recipes that calibrate): the layer in float32 twice (the torch module and the statistics' copy),
  one Gram matrix per linear (AWQ, GPTQ: K x K float32), and the calibration set's activations at the layer's
  widest input.

The figures are upper bounds by design; ``benchmarks/bench_build_scale.py`` prints them beside measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.quant.layer_names import layer_of

GB = 1 << 30
# Python, torch, transformers, ONNX Runtime and the traced graph of a large model, measured: 0.55 GB at the
# 1B shape's passes stage; rounded up for larger graphs and allocator slack.
BASE = 1 * GB
ROUND_TOKENS = 4096  # the accuracy report's default token limit (quant.evaluate.Precision.max_tokens)
# llmc.quant.layerwise.LayerwiseScorer.BATCH_TOKENS (held-out windows run together as one scoring step), not imported:
# a cache hit reads this module and must not load onnx_ir (tests/test_layerwise.py holds the two equal).
GROUP_TOKENS = 2048


@dataclass
class Estimate:
    """Bytes: ``need`` in all; ``largest`` names the largest layer (``largest_bytes`` in float32)."""

    need: int
    largest: str
    largest_bytes: int
    scoring: int
    calibration: int

    def to_json(self) -> dict:
        return {"need_gb": round(self.need / GB, 3), "largest": self.largest,
                "largest_fp32_gb": round(self.largest_bytes / GB, 3), "scoring_gb": round(self.scoring / GB, 3),
                "calibration_gb": round(self.calibration / GB, 3)}


def estimate(tensors: dict, config: dict, recipe, round_tokens: int = ROUND_TOKENS) -> Estimate:
    """The build's need for the checkpoint index ``tensors`` (name -> entry with ``shape``), its ``config`` and
    the quantization ``recipe`` (llmc.quant.recipe.QuantRecipe)."""
    layers: dict[str, int] = {}
    grams: dict[str, int] = {}
    widest: dict[str, int] = {}
    for name, entry in tensors.items():
        layer = layer_of(name)
        key = f"layer {layer}" if layer is not None else name
        n = 1
        for d in entry.shape:
            n *= int(d)
        layers[key] = layers.get(key, 0) + 4 * n
        if layer is not None and len(entry.shape) == 2:
            k = int(entry.shape[1])
            grams[key] = grams.get(key, 0) + 4 * k * k
            widest[key] = max(widest.get(key, 0), k, int(entry.shape[0]))
    largest = max(layers, key=layers.get) if layers else "(no tensors)"
    size = layers.get(largest, 0)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 0)
    vocab = int(config.get("vocab_size") or 0)
    scoring = 2 * size + round_tokens * 4 * (4 * hidden + 2 * vocab) + step_bytes(min(round_tokens, GROUP_TOKENS),
                                                                               config)
    calibration = 0
    if recipe.enabled and recipe.needs_calibration():
        tokens = recipe.calib_samples * recipe.calib_seq_len
        layer_keys = [k for k in layers if k.startswith("layer ")]
        biggest = max(layer_keys, key=layers.get) if layer_keys else largest
        searching = recipe.format is not None and recipe.format.algorithm in ("awq", "gptq")
        calibration = (2 * layers.get(biggest, 0) + (grams.get(biggest, 0) if searching else 0)
                       + 3 * tokens * 4 * max(widest.get(biggest, 0), hidden))
    if not recipe.enabled:  # nothing scored or calibrated: one tensor at a time is converted and written
        return Estimate(BASE + size, largest, size, 0, 0)
    return Estimate(BASE + max(scoring, calibration), largest, size, scoring, calibration)


MIN_ROUND = 256  # one held-out window: a round is never smaller


def check(limit: int | None, tensors: dict, config: dict, recipe) -> tuple[Estimate, int | None]:
    """The estimate, and the accuracy report's round size in tokens under ``limit`` bytes (None: no limit, the
    default rounds). Raises LlmcError (exit 5) naming the need when even the smallest rounds cannot fit."""
    from llmc.errors import EXIT_OUT_OF_MEMORY, LlmcError

    est = estimate(tensors, config, recipe)
    if limit is None:
        return est, None
    smallest = estimate(tensors, config, recipe, round_tokens=MIN_ROUND)
    if smallest.need > limit:
        parts = [f"the largest layer ({smallest.largest}) is {smallest.largest_bytes / GB:.2f} GB in float32"]
        if smallest.scoring:
            parts.append("held twice while the accuracy report scores it")
        if smallest.calibration > smallest.scoring:
            parts.append(f"calibrating it takes {smallest.calibration / GB:.2f} GB")
        raise LlmcError(f"--max-memory {limit / GB:.2f} GB: this build needs about {smallest.need / GB:.1f} GB "
                        f"({', '.join(parts)}, plus {BASE / GB:.0f} GB for the toolchain); raise --max-memory to at "
                        f"least {smallest.need / GB + 0.05:.1f}G, or build without it", exit_code=EXIT_OUT_OF_MEMORY)
    return est, max(MIN_ROUND, tokens_that_fit(limit, est, config))


def step_bytes(tokens: int, config: dict) -> int:
    """float32 working values of one scoring step of ``tokens`` tokens: the MLP's gate, up and product
    ``[tokens, intermediate]`` and two hidden-wide values (the step's logits are counted with the round's)."""
    hidden = int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 0)
    inter = config.get("intermediate_size") or config.get("n_inner") or config.get("ffn_dim") or 4 * hidden
    inter = max(inter) if isinstance(inter, list) else int(inter)
    return tokens * 4 * (3 * inter + 2 * hidden)


def tokens_that_fit(limit: int, est: Estimate, config: dict) -> int:
    """Tokens a round of the accuracy report may hold under ``limit`` bytes beside the largest stage and the
    working values of a step of as many tokens (at most ``GROUP_TOKENS``)."""
    hidden = int(config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 1)
    vocab = int(config.get("vocab_size") or 1)
    room = limit - BASE - 2 * est.largest_bytes
    per_token = 4 * (4 * hidden + 2 * vocab)
    grouped = step_bytes(1, config)
    if room <= GROUP_TOKENS * (per_token + grouped):  # rounds of at most a group: a step's values per token too
        return max(0, room // (per_token + grouped))
    return max(0, (room - step_bytes(GROUP_TOKENS, config)) // per_token)
