"""Idefics3 / SmolVLM's vision encoder as one graph over any number of tiles, and its prompt layout (issue 49).

Idefics3ImageProcessor cuts an image into ``rows x cols`` tiles of ``max_image_size`` pixels (row-major) plus the
whole image shrunk to one tile (the global image, last); every frame is a full tile, so its pixel mask is all ones.
transformers' ``get_image_features`` drops all-zero padding frames with a boolean index (a data-dependent shape no
graph holds) and splits its output per image with ``.tolist()``; the runtime encodes one image per call, so this
module runs the same modules on that image's frames, their count symbolic: the SigLIP tower with an all-ones patch
mask, then the connector's pixel shuffle and projection. Output: ``[tiles, image_seq_len, text hidden]``, which the
runtime places at the image tokens of Idefics3Processor's layout (:class:`TileLayout`, llmc.runtime.image_inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from llmc.errors import UnsupportedError

ENCODER_INPUTS = ("pixel_values",)
EXAMPLE_TILES = 3  # the traced example's frames (a 1x2 grid and its global image); any count runs
MAX_TILES = 1024
# Idefics3Processor's names of the tokens around each tile's image tokens
FAKE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<global-img>"


@dataclass(frozen=True)
class TileLayout:
    """The token ids of Idefics3Processor's layout of one image: ``<fake_token_around_image>``, ``<global-img>``,
    ``<row_i_col_j>`` for every tile of the processor's largest grid (``tile_ids[i][j]``), and the ids of the
    ``"\\n"`` after each tile row and of the ``"\\n\\n"`` that ends the last row (the row's newline and the one
    before the global image, tokenized together)."""

    fake_id: int
    global_id: int
    tile_ids: tuple[tuple[int, ...], ...]
    newline: tuple[int, ...]
    blank_line: tuple[int, ...]

    def as_manifest(self) -> dict:
        return {"fake_token_id": self.fake_id,
                "global_token_id": self.global_id, "tile_token_ids": [list(r) for r in self.tile_ids],
                "newline_ids": list(self.newline), "blank_line_ids": list(self.blank_line)}


def tower_side(config: dict) -> int:
    """The vision tower's image size in pixels (config.json's ``vision_config.image_size``; Idefics3VisionConfig's
    default 224)."""
    return int((config.get("vision_config") or {}).get("image_size", 224))


def processor_json(raw: dict | None, config: dict) -> dict:
    """The image processor's JSON: the checkpoint's, else Idefics3ImageProcessor's defaults at the tower's tile
    (``max_image_size`` = the vision ``image_size``, the longest edge four tiles, as its class defaults are for
    364-pixel tiles)."""
    if raw is not None:
        return raw
    tile = tower_side(config)
    return {"max_image_size": {"longest_edge": tile}, "size": {"longest_edge": 4 * tile}}


def max_grid(processor, checkpoint: Path) -> int:
    """The most tiles along one side an image can be cut into by ``processor`` (an ImageProcessorConfig): its
    resized longest edge (at most 4096) in whole tiles; 0 when it does not split images."""
    if not processor.do_image_splitting:
        return 0
    tile = int(processor.max_image_size["longest_edge"])
    size = processor.size or {}
    if processor.do_resize and size.get("longest_edge"):
        return math.ceil(min(int(size["longest_edge"]), 4096) / tile)
    if processor.do_resize and size.get("height") and size.get("width"):
        return math.ceil(max(int(size["height"]), int(size["width"])) / tile)
    raise UnsupportedError(f"{checkpoint / 'preprocessor_config.json'}: do_resize false (or a size without "
                           "longest_edge / height and width) cuts images into any number of tiles, and llmc reads "
                           "each tile's <row_i_col_j> token from the tokenizer at build time; set do_resize true "
                           "with size {\"longest_edge\": N}")


def check_tile(processor, config: dict, checkpoint: Path) -> None:
    """The processor's tile is the tower's image size: transformers' image_seq_len (each tile's image tokens) and
    its patch positions are the tower's, so any other tile gives a prompt the model refuses."""
    tile = int(processor.max_image_size["longest_edge"])
    side = tower_side(config)
    if tile != side:
        raise UnsupportedError(f"{checkpoint / 'preprocessor_config.json'}: max_image_size.longest_edge {tile} is "
                               f"not the vision tower's image_size {side} (config.json vision_config), and each tile "
                               f"must be one tower image; set max_image_size to {{\"longest_edge\": {side}}}")


def layout(processor, checkpoint: Path) -> TileLayout:
    """The ids of the layout's tokens from the checkpoint's tokenizer, for images cut by ``processor`` (an
    ImageProcessorConfig); refused in one line when one is missing. The build asks before tracing (the refusal
    comes before any work) and again for the manifest."""
    from llmc.runtime.tokenizer import Tokenizer

    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedError(f"{checkpoint}: Idefics3 lays out an image's tiles with tokens llmc reads from the "
                               "checkpoint's tokenizer.json, which is missing; add the tokenizer files the "
                               "checkpoint was published with, or build with --text-only")
    tok = Tokenizer(checkpoint)
    side = max_grid(processor, checkpoint)
    names = [FAKE_TOKEN, GLOBAL_TOKEN, *(f"<row_{i + 1}_col_{j + 1}>" for i in range(side) for j in range(side))]
    ids = {n: tok.encode(n, add_special_tokens=False) for n in names}
    missing = [n for n in names if len(ids[n]) != 1]
    if missing:
        raise UnsupportedError(
            f"{path}: Idefics3 lays out an image's tiles with the tokens {FAKE_TOKEN}, {GLOBAL_TOKEN} and "
            f"<row_i_col_j> up to the processor's {side}x{side} grid, but the tokenizer has no single token "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; add the tokenizer files the checkpoint "
            "was published with, or build with --text-only")
    grid = tuple(tuple(ids[f"<row_{i + 1}_col_{j + 1}>"][0] for j in range(side)) for i in range(side))
    return TileLayout(ids[FAKE_TOKEN][0], ids[GLOBAL_TOKEN][0], grid,
                      tuple(tok.encode("\n", add_special_tokens=False)),
                      tuple(tok.encode("\n\n", add_special_tokens=False)))


def encoder_module(torch, hf):
    """``pixel_values [tiles, 3, S, S]`` to ``image_features [tiles, image_seq_len, text hidden]`` through the
    wrapper's own modules (``inner`` is the wrapper: parameters named as the text model's)."""

    class Idefics3Encoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            model = self.inner.model
            patch = int(model.config.vision_config.patch_size)
            # every frame is a whole tile: get_image_features' patch mask of it is all ones
            mask = torch.ones(pixel_values.shape[0], pixel_values.shape[2] // patch, pixel_values.shape[3] // patch,
                              dtype=torch.bool)
            hidden = model.vision_model(pixel_values=pixel_values, patch_attention_mask=mask).last_hidden_state
            return model.connector(hidden).float()

    return Idefics3Encoder(hf).eval()


def example(torch, side: int) -> tuple[tuple, dict]:
    """The traced example (:data:`EXAMPLE_TILES` tiles of ``side`` pixels) and its dynamic tile count."""
    tiles = torch.export.Dim("tiles", min=1, max=MAX_TILES)
    return (torch.randn(EXAMPLE_TILES, 3, side, side),), {"pixel_values": {0: tiles}}
