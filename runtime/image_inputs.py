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

A dynamic-resolution M-RoPE engine (Qwen3.5; manifest ``multimodal.positions == "mrope"``): each image's token count
follows its grid (``grid_h * grid_w / merge²``), its encoder graph takes the grid-derived inputs
(llmc.runtime.vision.qwen_grid), and every step also feeds ``mrope_positions`` ``[3, T]`` (llmc.runtime.mrope) from
each request's prompt table and position delta.

A tiled engine (Idefics3; manifest ``multimodal.layout == "tiles"``): the processor cuts each image into rows x cols
tiles plus a global image, the encoder graph takes all of them at once (``[tiles, tokens per tile, hidden]``), and
the placeholder becomes Idefics3Processor's layout of them (each tile's ``<fake_token_around_image><row_i_col_j>``
and image tokens, a newline after each row, then the global image's), its features at the image tokens only.
Llama 4 (``layout == "separators"``) likewise, in Llama4Processor's layout: ``<|image_start|>``, each tile's patch
tokens with ``<|tile_x_separator|>`` between a row's tiles and ``<|tile_y_separator|>`` after each row, then
``<|image|>`` (also the prompt's placeholder), the global tile's patches and ``<|image_end|>``.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
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
    grid: tuple[int, int] | None = None  # merged (rows, columns) of a dynamic-resolution image: its M-RoPE layout
    # Mistral 3: the span's tokens (image tokens and the break tokens between rows) and each feature's offset in it;
    # None: every token of the span is an image token
    tokens: tuple[int, ...] | None = None
    slots: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.start + (len(self.embeds) if self.tokens is None else len(self.tokens))

    def features_in(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(token indices, features)`` of this image's feature tokens at request positions ``[lo, hi)``."""
        if self.slots is None:
            a, b = max(lo, self.start), min(hi, self.end)
            return np.arange(a, max(a, b), dtype=np.int64), self.embeds[a - self.start: max(a, b) - self.start]
        at = self.start + self.slots
        keep = (at >= lo) & (at < hi)
        return at[keep], self.embeds[keep]


@dataclass(frozen=True)
class EncodedImage:
    """One image already preprocessed and encoded (:meth:`ImageInputs.prefetch`): what a request's placeholder
    expands to, with no further work. ``Engine.submit`` takes it wherever it takes an image."""

    digest: bytes  # sha256 of the pixel values (and layout): the cache and prefix-cache key
    embeds: np.ndarray  # [features, hidden] float32
    grid: tuple[int, int] | None


class ImageInputs:
    """The artifact's image processor and encoder graph, and the encoder outputs cached by image content.

    Thread-safe: the encoder runs outside any lock, so images can be encoded (:meth:`prefetch`) on other threads
    while the engine steps (``Engine.submit`` does so before taking the engine's lock; the server on a worker
    thread before the step loop sees the request)."""

    def __init__(self, root: Path, manifest: dict, threads: int | None = None, device: str | None = None) -> None:
        from llmc.runtime.vision import load_processor

        section = manifest["multimodal"]
        self.root, self.manifest, self.threads = root, manifest, threads
        self.device = device  # a CUDA engine's: where its encoder's program runs (the language model's device)
        self.graph_name = section["encoder_graph"]
        self.token_id = int(section["image_token_id"])
        self.tokens_per_image = section["tokens_per_image"]  # None: dynamic resolution (Qwen)
        self.hidden_size = int(section["hidden_size"])
        self.mrope = section.get("positions") == "mrope"
        # Mistral 3: rows of image tokens, each closed by the break token, the last by the end token
        self.rows = section.get("layout") == "rows"
        self.token_pixels = int(section.get("token_pixels") or 1)
        self.break_id, self.end_id = section.get("image_break_token_id"), section.get("image_end_token_id")
        # Gemma 3: the placeholder is its start-of-image token; each image's tokens come between the prefix and the
        # suffix tokens, and attend to each other both ways (the language model's attend_end input)
        self.wrap = section.get("layout") == "wrap"
        self.placeholder = int(section.get("placeholder_token_id") or self.token_id)
        self.prefix = tuple(int(t) for t in section.get("image_prefix") or ())
        self.suffix = tuple(int(t) for t in section.get("image_suffix") or ())
        self.bidirectional = bool(section.get("bidirectional"))
        # Idefics3: tiles and a global image, each tile's image tokens after the fake token and its <row_i_col_j>
        self.tiles = section.get("layout") == "tiles"
        self.fake_id, self.global_id = section.get("fake_token_id"), section.get("global_token_id")
        self.tile_ids = [[int(t) for t in row] for row in section.get("tile_token_ids") or ()]
        self.newline = tuple(int(t) for t in section.get("newline_ids") or ())
        self.blank_line = tuple(int(t) for t in section.get("blank_line_ids") or ())
        # Llama 4: tiles between separator tokens
        self.separators = section.get("layout") == "separators"
        self.separator_ids = {k: section.get(k) for k in ("image_start_id", "image_end_id", "image_marker_id",
                                                          "tile_x_separator_id", "tile_y_separator_id")}
        self.merge_size = int(section.get("merge_size") or 1)
        # an image row: its features, then Qwen3-VL's deepstack features for each of its first layers
        self.embeds_width = self.hidden_size * (1 + int(section.get("deepstack_layers") or 0))
        self.processor = load_processor(root)
        if self.processor is None:
            raise LlmcError(f"{root}: the manifest names an image encoder but the artifact has no image processor "
                            "(image_processor.json); rebuild it")
        self._encoder = None  # the encoder graph's session, opened on the first image
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the cache, the counters and opening the encoder
        self.encoded = 0  # images the encoder ran on (cache misses)
        self.encode_threads: Counter[str] = Counter()  # the threads the encoder ran on, by name (how many runs)

    @classmethod
    def of(cls, root: Path, manifest: dict, threads: int | None = None,
           device: str | None = None) -> ImageInputs | None:
        """The engine's image inputs, or None for an engine that takes no images."""
        return cls(root, manifest, threads, device) if (manifest.get("multimodal") or {}).get("encoder_graph") else None

    def expand(self, ids: list[int], images: Sequence, label: str) -> tuple[list[int], list[ImageSpan], int]:
        """``(tokens, spans, key)``: ``ids`` with each placeholder token expanded to its image's tokens, each
        image's span, and the prefix-cache key of these images (never 0)."""
        at = [i for i, t in enumerate(ids) if t == self.placeholder]
        if len(at) != len(images):
            raise LlmcError(f"{label}: {len(images)} images but {len(at)} image placeholders (token "
                            f"{self.placeholder}) in the prompt; put one placeholder where each image goes")
        features = [self._encode(image) for image in images]
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for pos, (_, embeds, grid) in zip(at, features, strict=True):
            out.extend(ids[prev:pos])
            if self.wrap:
                tokens = (*self.prefix, *[self.token_id] * len(embeds), *self.suffix)
                slots = np.arange(len(self.prefix), len(self.prefix) + len(embeds), dtype=np.int64)
                spans.append(ImageSpan(len(out), embeds, None, tokens, slots))
                out.extend(tokens)
            elif self.rows or self.tiles or self.separators:
                tokens, slots = (self._rows_layout(grid) if self.rows else self._tiles_layout(grid, len(embeds), label)
                                 if self.tiles else self._separators_layout(grid, len(embeds)))
                spans.append(ImageSpan(len(out), embeds, None, tokens, slots))
                out.extend(tokens)
            else:
                spans.append(ImageSpan(len(out), embeds, grid))
                out.extend([self.token_id] * len(embeds))
            prev = pos + 1
        out.extend(ids[prev:])
        digest = hashlib.sha256(b"".join(d for d, _, _ in features)).digest()
        return out, spans, int.from_bytes(digest[:8], "little") | (1 << 41)

    def _rows_layout(self, grid: tuple[int, int]) -> tuple[tuple[int, ...], np.ndarray]:
        """PixtralProcessor's tokens of one image of ``grid`` (rows, columns) tokens: each row's image tokens then
        the break token, the last row's break token replaced by the end token; and the image tokens' offsets."""
        rows, cols = grid
        tokens = ([self.token_id] * cols + [self.break_id]) * rows
        tokens[-1] = self.end_id
        slots = np.asarray([r * (cols + 1) + c for r in range(rows) for c in range(cols)], np.int64)
        return tuple(int(t) for t in tokens), slots

    def _tiles_layout(self, grid: tuple[int, int], count: int, label: str) -> tuple[tuple[int, ...], np.ndarray]:
        """Idefics3Processor's tokens of one image cut into ``grid`` (rows, columns) tiles (0, 0: not cut) whose
        ``count`` features are each tile's, row-major, then the global image's; and the image tokens' offsets. Its
        text is ``<fake><row_i_col_j>`` + image tokens per tile, ``"\\n"`` after each row, then ``"\\n<fake>
        <global-img>"`` + image tokens + ``<fake>``: the last row's newline and the next one are one ``"\\n\\n"``
        between special tokens, tokenized together."""
        rows, cols = grid
        if rows > len(self.tile_ids) or cols > len(self.tile_ids):
            raise LlmcError(f"{label}: the image is cut into {rows}x{cols} tiles, past the {len(self.tile_ids)}x"
                            f"{len(self.tile_ids)} whose <row_i_col_j> tokens the engine holds (manifest "
                            "multimodal.tile_token_ids); rebuild the engine with this image processor")
        per = count // (rows * cols + 1)
        tokens: list[int] = []
        slots: list[int] = []

        def image_tokens() -> None:
            slots.extend(range(len(tokens), len(tokens) + per))
            tokens.extend([self.token_id] * per)

        for r in range(rows):
            for c in range(cols):
                tokens.extend((self.fake_id, self.tile_ids[r][c]))
                image_tokens()
            tokens.extend(self.newline if r < rows - 1 else self.blank_line)
        tokens.extend((self.fake_id, self.global_id))
        image_tokens()
        tokens.append(self.fake_id)
        return tuple(int(t) for t in tokens), np.asarray(slots, np.int64)

    def _separators_layout(self, grid: tuple[int, int], count: int) -> tuple[tuple[int, ...], np.ndarray]:
        """Llama4Processor's ``_prompt_split_image`` for an image of ``grid`` (rows, columns) tiles whose ``count``
        features are each tile's (row-major) then, for more than one tile, the global tile's; and the patch tokens'
        offsets."""
        ids = self.separator_ids
        rows, cols = grid
        per = count // (rows * cols + 1 if rows * cols > 1 else 1)
        tokens: list[int] = [ids["image_start_id"]]
        slots: list[int] = []

        def patches() -> None:
            slots.extend(range(len(tokens), len(tokens) + per))
            tokens.extend([self.token_id] * per)

        if rows * cols > 1:
            for _ in range(rows):
                for c in range(cols):
                    patches()
                    if c < cols - 1:
                        tokens.append(ids["tile_x_separator_id"])
                tokens.append(ids["tile_y_separator_id"])
        tokens.append(ids["image_marker_id"])
        patches()
        tokens.append(ids["image_end_id"])
        return tuple(int(t) for t in tokens), np.asarray(slots, np.int64)

    def prefetch(self, images: Sequence) -> list[EncodedImage]:
        """Preprocess and encode ``images`` now, on this thread (cached by content): the :class:`EncodedImage` s a
        request then takes with no encoder work on the thread that steps the engine."""
        return [image if isinstance(image, EncodedImage) else EncodedImage(*self._encode(image)) for image in images]

    def encode(self, image) -> tuple[bytes, np.ndarray]:
        """``(sha256 of its pixel values, features [tokens, hidden])`` of one image (a path, bytes or an array;
        llmc.runtime.vision.decode_image), the encoder run only when its pixels are not cached."""
        digest, embeds, _ = self._encode(image)
        return digest, embeds

    def _encode(self, image) -> tuple[bytes, np.ndarray, tuple[int, int] | None]:
        """:meth:`encode` and, for a dynamic-resolution image, its merged grid (rows, columns)."""
        if isinstance(image, EncodedImage):
            return image.digest, image.embeds, image.grid
        processed = self.processor([image])
        pixels = np.ascontiguousarray(processed.pixel_values, dtype=np.float32)
        grid = processed.extras.get("image_grid_thw") if self.mrope else None
        # the grid is part of the key: the same patches in another layout are another image
        digest = hashlib.sha256(pixels.tobytes() + (grid.tobytes() if grid is not None else b"")).digest()
        merged = None if grid is None else (int(grid[0, 1]) // self.merge_size, int(grid[0, 2]) // self.merge_size)
        positions = processed.extras.get("image_position_ids")  # Gemma 4: each patch's (x, y), -1 for padding
        if positions is not None:
            digest = hashlib.sha256(digest + np.ascontiguousarray(positions, np.int64).tobytes()).digest()
        if self.tiles or self.separators:  # the frames of one image, and its tile grid (the key holds both)
            if self.tiles:
                rows, cols = int(processed.extras["rows"][0, 0]), int(processed.extras["cols"][0, 0])
                pixels = pixels[0]
            else:  # Llama 4: [tiles, 3, S, S] and each image's (rows, columns)
                rows, cols = (int(v) for v in processed.extras["aspect_ratios"][0])
            merged = (rows, cols)
            digest = hashlib.sha256(pixels.tobytes() + np.asarray([rows, cols], np.int64).tobytes()).digest()
        if self.rows:  # one image per call: its pixels are its size, whole tokens (the key holds the shape too)
            merged = (pixels.shape[-2] // self.token_pixels, pixels.shape[-1] // self.token_pixels)
            digest = hashlib.sha256(pixels.tobytes() + np.asarray(pixels.shape, np.int64).tobytes()).digest()
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return digest, hit, merged
            if self._encoder is None:
                from llmc.runtime.graphs import load_graph

                self._encoder = load_graph(self.root, self.manifest, self.graph_name, self.threads, self.device)
        # the encoder runs outside the lock: another thread's steps and cache hits go on meanwhile
        feeds = self._encoder_feeds(pixels, grid)
        if positions is not None:
            feeds[self._encoder.inputs[1]] = np.ascontiguousarray(positions, np.int64)
        (features,) = self._encoder.run(feeds)
        count = processed.extras.get("num_soft_tokens_per_image")
        # Gemma 4: the encoder pools the padded patch budget; the image's soft tokens are the first rows
        if self.tiles or self.separators:  # [tiles, tokens per tile, hidden]: the tiles, row-major, then the global
            features = features.reshape(1, -1, features.shape[-1])
        embeds = np.ascontiguousarray(features[0] if count is None else features[0][: int(count[0])], np.float32)
        with self._lock:
            self.encoded += 1
            self.encode_threads[threading.current_thread().name] += 1
            self._cache[digest] = embeds
            if len(self._cache) > CACHE_IMAGES:
                self._cache.popitem(last=False)
        return digest, embeds, merged

    def _encoder_feeds(self, pixels: np.ndarray, grid: np.ndarray | None) -> dict[str, np.ndarray]:
        """The encoder graph's inputs: the pixels, and a dynamic-resolution encoder's grid-derived inputs."""
        feeds = {self._encoder.inputs[0]: pixels}
        if grid is not None:
            from llmc.runtime.vision.qwen_grid import encoder_inputs

            side = int(self.manifest["multimodal"]["position_table_side"])
            feeds.update(encoder_inputs(tuple(grid[0]), self.merge_size, side))
        return feeds

    def positions(self, num_tokens: int, spans: list[ImageSpan] | None) -> tuple[np.ndarray | None, int]:
        """A request's M-RoPE prompt table ``[3, num_tokens]`` and position delta (llmc.runtime.mrope); ``(None, 0)``
        on an engine of 1-D positions or for a request without images."""
        if not self.mrope or not spans:
            return None, 0
        from llmc.runtime.mrope import prompt_positions

        return prompt_positions(num_tokens, [(sp.start, *sp.grid) for sp in spans])

    def feeds(self, chunks: Sequence, query_start_loc: np.ndarray) -> dict[str, np.ndarray]:
        """``image_embeds`` ``[M, hidden]`` and ``image_rows`` ``[M]``: the image tokens the step's ``chunks``
        compute (a chunk computes its request's tokens ``[start, start + num_tokens)`` at packed rows from
        ``query_start_loc[i]``)."""
        rows, embeds = [], []
        for i, c in enumerate(chunks):
            for span in c.request.image_spans or ():
                at, feats = span.features_in(c.start, c.start + c.num_tokens)
                if len(at):
                    rows.append(at - c.start + int(query_start_loc[i]))
                    embeds.append(feats)
        out = {"image_embeds": np.concatenate(embeds), "image_rows": np.concatenate(rows)} if rows else \
            {"image_embeds": np.zeros((0, self.embeds_width), np.float32), "image_rows": np.zeros(0, np.int64)}
        if self.bidirectional:  # each image token sees its image's later tokens: attend_end = the image's end
            total = int(query_start_loc[len(chunks)]) if len(chunks) else 0
            ends = np.zeros(total, np.int64)
            for i, c in enumerate(chunks):
                for span in c.request.image_spans or ():
                    at, _ = span.features_in(c.start, c.start + c.num_tokens)
                    if len(at):
                        ends[at - c.start + int(query_start_loc[i])] = span.start + span.slots[-1] + 1
            out["attend_end"] = ends
        if self.mrope:
            from llmc.runtime.mrope import positions_of

            out["mrope_positions"] = np.concatenate(
                [positions_of(c.request.image_positions, c.request.position_delta, c.start, c.num_tokens)
                 for c in chunks] or [np.zeros((3, 0), np.int64)], axis=1)
        return out

    def atomic_spans(self, spans: list[ImageSpan] | None) -> list[tuple[int, int]] | None:
        """The token ranges ``[start, end)`` a prefill chunk must not end inside: each image's tokens of a
        bidirectional engine (a token attends to its image's later ones, written in the same step)."""
        if not self.bidirectional or not spans:
            return None
        return [(sp.start + int(sp.slots[0]), sp.start + int(sp.slots[-1]) + 1) for sp in spans]

    def empty(self, positions: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The feeds of a step without image tokens, whose tokens sit at ``positions`` ``[T]``."""
        out = self.feeds((), np.zeros(1, np.int64))
        if self.bidirectional:
            out["attend_end"] = np.zeros(len(positions) if positions is not None else 0, np.int64)
        if self.mrope:
            p = np.asarray(positions if positions is not None else (), np.int64)
            out["mrope_positions"] = np.broadcast_to(p, (3, len(p))).copy()
        return out
