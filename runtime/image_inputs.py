"""Images in a request (issue 49 item 4): the prompt's placeholders expanded, the encoder run once per image, and
each step's image rows fed to the language model.

An engine built with its vision encoder (manifest ``multimodal.encoder_graph``) holds one :class:`ImageInputs`.
A request's images are preprocessed by the artifact's image processor (llmc.runtime.vision), their pixel values
hashed (sha256), and the encoder graph runs once for the images not yet in the cache (LRU, by that hash). The
prompt's single placeholder token per image becomes the image's ``tokens_per_image`` placeholder tokens, as
transformers' processor expands it; the request keeps each image's span and features. A step feeds
``image_embeds`` ``[M, hidden]`` and ``image_rows`` ``[M]`` (rows of the packed step) for the part of every span
its chunks compute, so a prefill chunk may split an image. Prefix-cache blocks of an image request are keyed by
its images' hashes (the root of its block hash chain): the same images and text hit, other images miss.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError

CACHE_IMAGES = 256  # encoder outputs kept (LRU)
IMAGE_INPUTS = ("image_embeds", "image_rows")


@dataclass(frozen=True)
class ImageSpan:
    """One image of a request: its first token's index in the request's tokens and its features
    ``[tokens_per_image, hidden]`` float32 (the encoder's output)."""

    start: int
    embeds: np.ndarray

    @property
    def end(self) -> int:
        return self.start + len(self.embeds)


class ImageInputs:
    """The artifact's image processor and encoder graph, and the encoder outputs cached by image content."""

    def __init__(self, root: Path, manifest: dict, threads: int | None = None) -> None:
        from llmc.runtime.vision import load_processor

        section = manifest["multimodal"]
        self.root, self.manifest, self.threads = root, manifest, threads
        self.graph_name = section["encoder_graph"]
        self.token_id = int(section["image_token_id"])
        self.tokens_per_image = int(section["tokens_per_image"])
        self.hidden_size = int(section["hidden_size"])
        self.processor = load_processor(root)
        if self.processor is None:
            raise LlmcError(f"{root}: the manifest names an image encoder but the artifact has no image processor "
                            "(image_processor.json); rebuild it")
        self._encoder = None  # the encoder graph's session, opened on the first image
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.encoded = 0  # images the encoder ran on (cache misses)

    @classmethod
    def of(cls, root: Path, manifest: dict, threads: int | None = None) -> ImageInputs | None:
        """The engine's image inputs, or None for an engine that takes no images."""
        return cls(root, manifest, threads) if (manifest.get("multimodal") or {}).get("encoder_graph") else None

    def expand(self, ids: list[int], images: Sequence, label: str) -> tuple[list[int], list[ImageSpan], int]:
        """``(tokens, spans, key)``: ``ids`` with each placeholder token expanded to its image's tokens, each
        image's span, and the prefix-cache key of these images (never 0)."""
        at = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(at) != len(images):
            raise LlmcError(f"{label}: {len(images)} images but {len(at)} image placeholders (token "
                            f"{self.token_id}) in the prompt; put one placeholder where each image goes")
        features = [self.encode(image) for image in images]
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for pos, (_, embeds) in zip(at, features, strict=True):
            out.extend(ids[prev:pos])
            spans.append(ImageSpan(len(out), embeds))
            out.extend([self.token_id] * len(embeds))
            prev = pos + 1
        out.extend(ids[prev:])
        digest = hashlib.sha256(b"".join(d for d, _ in features)).digest()
        return out, spans, int.from_bytes(digest[:8], "little") | (1 << 41)

    def encode(self, image) -> tuple[bytes, np.ndarray]:
        """``(sha256 of its pixel values, features [tokens_per_image, hidden])`` of one image (a path, bytes or an
        array; llmc.runtime.vision.decode_image), the encoder run only when its pixels are not cached."""
        pixels = np.ascontiguousarray(self.processor([image]).pixel_values, dtype=np.float32)
        digest = hashlib.sha256(pixels.tobytes()).digest()
        hit = self._cache.get(digest)
        if hit is not None:
            self._cache.move_to_end(digest)
            return digest, hit
        if self._encoder is None:
            from llmc.runtime.graphs import load_graph

            self._encoder = load_graph(self.root, self.manifest, self.graph_name, self.threads)
        (features,) = self._encoder.run({self._encoder.inputs[0]: pixels})
        embeds = np.ascontiguousarray(features[0], dtype=np.float32)
        self.encoded += 1
        self._cache[digest] = embeds
        if len(self._cache) > CACHE_IMAGES:
            self._cache.popitem(last=False)
        return digest, embeds

    def feeds(self, chunks: Sequence, query_start_loc: np.ndarray) -> dict[str, np.ndarray]:
        """``image_embeds`` ``[M, hidden]`` and ``image_rows`` ``[M]``: the image tokens the step's ``chunks``
        compute (a chunk computes its request's tokens ``[start, start + num_tokens)`` at packed rows from
        ``query_start_loc[i]``)."""
        rows, embeds = [], []
        for i, c in enumerate(chunks):
            for span in c.request.image_spans or ():
                lo, hi = max(span.start, c.start), min(span.end, c.start + c.num_tokens)
                if lo < hi:
                    rows.append(np.arange(lo, hi, dtype=np.int64) - c.start + int(query_start_loc[i]))
                    embeds.append(span.embeds[lo - span.start: hi - span.start])
        if not rows:
            return {"image_embeds": np.zeros((0, self.hidden_size), np.float32),
                    "image_rows": np.zeros(0, np.int64)}
        return {"image_embeds": np.concatenate(embeds), "image_rows": np.concatenate(rows)}

    def empty(self) -> dict[str, np.ndarray]:
        """The feeds of a step without image tokens."""
        return self.feeds((), np.zeros(1, np.int64))
