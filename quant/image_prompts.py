"""Image prompts in the accuracy report of a quantized vision-language build (issue 49).

The encoder graph keeps the compute dtype (only the language model is quantized), so both sides of the comparison
take the same image features: the sealed artifact's own image processor and encoder (llmc.runtime.image_inputs)
encode each image once, and the unquantized and quantized language models score the same prompts, layer by layer,
with the features at the image tokens (and M-RoPE positions where the family has them). Prompts: held-out text
around one synthetic image each (smooth colour gradients plus noise, a fixed seed, sizes that differ per prompt so
dynamic-resolution families see several grids), the image placed at a different point of each window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

IMAGE_PROMPTS = 4
IMAGE_SEED = 20260
TEXT_TOKENS = 48  # held-out text tokens around each image


def synthetic_images(count: int, seed: int = IMAGE_SEED) -> list[np.ndarray]:
    """``count`` RGB images (uint8 ``[H, W, 3]``, H and W between 48 and 320 pixels) of a fixed seed."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        h, w = (int(v) for v in rng.integers(48, 321, 2))
        y, x = np.mgrid[0:h, 0:w]
        base = rng.uniform(0, 255, 3) + rng.uniform(-1, 1, 3) * (x[..., None] + y[..., None])
        out.append(np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8))
    return out


@dataclass
class ImageWindows:
    """The image prompts: each window's tokens (the image expanded) and its further language-model inputs."""

    windows: list[list[int]]
    extras: list[dict[str, np.ndarray]]
    image_tokens: int  # tokens the images fill, over all windows


def image_windows(engine_dir: Path, manifest: dict, text: list[list[int]], count: int = IMAGE_PROMPTS
                  ) -> ImageWindows | None:
    """``count`` prompts of held-out ``text`` around one image each, expanded by the artifact's processor and
    encoded by its encoder graph; None for an engine that takes no images."""
    from llmc.runtime.image_inputs import ImageInputs

    inputs = ImageInputs.of(engine_dir, manifest, threads=None)
    if inputs is None or not text:
        return None
    windows, extras, filled = [], [], 0
    for i, image in enumerate(synthetic_images(count)):
        words = text[i % len(text)][:TEXT_TOKENS]
        at = 1 + (i * 7) % max(1, len(words) - 1)
        ids, spans, _ = inputs.expand([*words[:at], inputs.placeholder, *words[at:]], [image], "accuracy report")
        table, delta = inputs.positions(len(ids), spans)
        # the whole prompt as one step's chunk: the feeds the runtime gives it (rows, M-RoPE, attend_end)
        chunk = SimpleNamespace(request=SimpleNamespace(image_spans=spans, image_positions=table,
                                                        position_delta=delta), start=0, num_tokens=len(ids))
        extra = inputs.feeds([chunk], np.asarray([0, len(ids)], np.int64))
        windows.append(ids)
        extras.append(extra)
        filled += len(extra["image_rows"])
    return ImageWindows(windows, extras, filled)


def compare_images(prompts: ImageWindows, reference, quantized, progress: Callable[[str], None] | None = None):
    """KL and top-1 agreement of the quantized language model against the unquantized one on the image prompts
    (``reference`` / ``quantized``: :class:`~llmc.quant.layerwise.LayerwiseScorer`); returns the report's
    ``accuracy_images`` entry."""
    from llmc.quant import evaluate

    ref = reference.run(prompts.windows, extras=prompts.extras)
    got = quantized.run(prompts.windows, extras=prompts.extras)
    acc = evaluate.compare(lambda i, _: evaluate.log_softmax(ref[i]), lambda i, _: got[i], prompts.windows,
                           progress=progress)
    return {"prompts": len(prompts.windows), "tokens": acc.tokens, "image_tokens": prompts.image_tokens,
            "kl_mean": float(f"{acc.kl_mean:.6g}"), "top1_agreement": float(f"{acc.top1_agreement:.6g}"),
            "images": f"{IMAGE_PROMPTS} synthetic images (seed {IMAGE_SEED}), one per prompt of held-out text, "
                      "encoded by the artifact's own encoder graph (not quantized)"}
