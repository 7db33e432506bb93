"""``llmc bench --image PATH``: a vision-language engine's image path, timed: preprocessing, the encoder graph,
and time to first token of a prompt with the image (the encoder included: every run's image is new to the
engine's encoder cache) beside the same prompt without it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.vision import decode_image


def _fresh(pixels: np.ndarray, k: int) -> np.ndarray:
    """The image with one pixel changed by ``k``: other content, so the encoder's cache misses."""
    out = pixels.copy()
    out[0, 0, 0] = (int(out[0, 0, 0]) + 1 + k) % 256
    return out


def image_row(engine: Engine, image: Path, input_len: int, repeats: int, warmup: int, seed: int,
              threads: int | None = None) -> dict:
    """Medians (ms) over ``repeats`` of: the image processor, the encoder graph alone, and TTFT of an
    ``input_len``-token prompt after the image (encoder included) and without it."""
    inputs = engine.images
    if inputs is None:
        raise LlmcError(f"--image {image}: the engine at {engine.path} takes no images (a text model, or a "
                        "vision-language model built --text-only); leave --image out")
    pixels = decode_image(image)
    rng = np.random.default_rng(seed + 11)
    text = rng.integers(4, engine.vocab_size, input_len).tolist()
    text = [t if t not in (inputs.token_id, inputs.placeholder) else 4 for t in text]
    prompt = [inputs.placeholder] + text  # the family's placeholder (Gemma 3: its start-of-image token)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    pre, enc, ttft, ttft_text = [], [], [], []
    for k in range(warmup + repeats):
        t0 = time.perf_counter()
        inputs.processor([_fresh(pixels, k)])
        t1 = time.perf_counter()
        # the engine's own encode (every family's encoder inputs), less the preprocessing timed above
        inputs.encode(_fresh(pixels, k))
        t2 = time.perf_counter() - (t1 - t0)
        with_image = engine.generate([prompt], once, images=[[_fresh(pixels, 1000 + k)]])[0]
        without = engine.generate([text], once)[0]
        if k >= warmup:
            pre.append(t1 - t0)
            enc.append(t2 - t1)
            ttft.append(with_image.ttft)
            ttft_text.append(without.ttft)

    def ms(xs: list[float]) -> float:
        return round(1000 * statistics.median(xs), 3)

    tokens = len(with_image.prompt_token_ids)
    return {"workload": "image", "image": str(image), "image_hw": list(pixels.shape[:2]),
            "image_tokens": tokens - len(text), "input_len": input_len, "preprocess_ms": ms(pre),
            "encoder_ms": ms(enc), "ttft_ms": ms(ttft), "ttft_text_only_ms": ms(ttft_text),
            "tok_s": round(tokens / statistics.median(ttft), 2), "tokens_requested": 1, "tokens_generated": 1}
