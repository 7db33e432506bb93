"""Llama 4's vision encoder as one graph over any number of tiles, and its prompt layout (issue 49).

Llama4ImageProcessor fits each image into a canvas of whole tiles (``size``) and cuts it into them row by row, plus a
global tile when there are several; ``get_image_features`` runs the vision model (unfold patch embedding, class
token, learned positions, 2-D rotary, blocks, pixel-shuffle MLP) and the projector on every tile independently, so
the graph is the wrapper's own ``get_image_features`` with the tile count symbolic: ``[tiles, 3, S, S]`` to
``[tiles, tokens per tile, text hidden]``. The runtime lays each image out as Llama4Processor's
``_prompt_split_image`` writes it (:class:`SeparatorLayout`, llmc.runtime.image_inputs): ``<|image_start|>``, each
tile's ``<|patch|>`` tokens with ``<|tile_x_separator|>`` between the tiles of a row and ``<|tile_y_separator|>``
after each row, then ``<|image|>``, the global tile's patches and ``<|image_end|>``; features at the patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmc.errors import UnsupportedError

ENCODER_INPUTS = ("pixel_values",)
EXAMPLE_TILES = 3  # the traced example's tiles (a 1x2 canvas and its global tile); any count runs
MAX_TILES = 1024
# Llama4Processor's token names (its defaults; released checkpoints keep them)
NAMES = {"start": "<|image_start|>", "end": "<|image_end|>", "image": "<|image|>",
         "tile_x": "<|tile_x_separator|>", "tile_y": "<|tile_y_separator|>"}


@dataclass(frozen=True)
class SeparatorLayout:
    """The ids of Llama4Processor's tokens around an image's patch tokens; ``image`` is also the prompt's
    placeholder (Llama4Processor's ``fake_image_token``)."""

    start: int
    end: int
    image: int
    tile_x: int
    tile_y: int

    def as_manifest(self) -> dict:
        return {"image_start_id": self.start, "image_end_id": self.end, "image_marker_id": self.image,
                "tile_x_separator_id": self.tile_x, "tile_y_separator_id": self.tile_y}


def tower_side(config: dict) -> int:
    """The vision model's image size in pixels (config.json's ``vision_config.image_size``; Llama4VisionConfig's
    default 448)."""
    return int((config.get("vision_config") or {}).get("image_size", 448))


def processor_json(raw: dict | None, config: dict) -> dict:
    """The image processor's JSON: the checkpoint's, else Llama4ImageProcessor's defaults with its tile the tower's
    image size."""
    if raw is not None:
        return raw
    side = tower_side(config)
    return {"size": {"height": side, "width": side}}


def check_tile(processor, config: dict, checkpoint: Path) -> None:
    """Each tile is one image of the vision model: its learned positions and rotary table are the tower's grid."""
    size = processor.size or {}
    side = tower_side(config)
    if (size.get("height"), size.get("width")) != (side, side):
        raise UnsupportedError(f"{checkpoint / 'preprocessor_config.json'}: size {size} is not the vision model's "
                               f"image_size {side} (config.json vision_config), and each tile must be one image of "
                               f"it; set size to {{\"height\": {side}, \"width\": {side}}}")


def layout(checkpoint: Path) -> SeparatorLayout:
    """The layout's token ids from the checkpoint's tokenizer; refused in one line when one is missing."""
    from llmc.runtime.tokenizer import Tokenizer

    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedError(f"{checkpoint}: Llama 4 lays out an image's tiles with tokens llmc reads from the "
                               "checkpoint's tokenizer.json, which is missing; add the tokenizer files the "
                               "checkpoint was published with, or build with --text-only")
    tok = Tokenizer(checkpoint)
    ids = {k: tok.encode(n, add_special_tokens=False) for k, n in NAMES.items()}
    missing = [NAMES[k] for k, v in ids.items() if len(v) != 1]
    if missing:
        raise UnsupportedError(f"{path}: Llama 4 lays out an image's tiles with {', '.join(NAMES.values())}, but "
                               f"the tokenizer has no single token {', '.join(missing)}; add the tokenizer files the "
                               "checkpoint was published with, or build with --text-only")
    return SeparatorLayout(**{k: v[0] for k, v in ids.items()})


def encoder_module(torch, hf):
    """``pixel_values [tiles, 3, S, S]`` to ``image_features [tiles, tokens per tile, text hidden]``: the wrapper's
    ``get_image_features`` (``inner`` is the wrapper: parameters named as the text model's), its 2-D rotary in real
    arithmetic (the ONNX graph holds no complex tensors): the rotary table as (cos, sin) pairs, and each (even, odd)
    pair of queries and keys multiplied as the complex product does, ``(a + bi)(c + di) = (ac - bd) + (ad + bc)i``
    in float32."""
    from transformers.models.llama4 import modeling_llama4

    class Llama4Encoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            # [patches + 1, 1, D/2, 2]: computed here, so the graph holds it as a real constant
            freqs = inner.vision_model.rotary_embedding.freqs_ci
            self.register_buffer("rotary_pairs", torch.view_as_real(freqs).clone(), persistent=False)

        def forward(self, pixel_values):
            rotary = self.inner.vision_model.rotary_embedding
            pairs = self.rotary_pairs
            before = modeling_llama4.vision_apply_rotary_emb
            rotary.forward = lambda hidden_states: pairs
            modeling_llama4.vision_apply_rotary_emb = _real_rotary
            try:
                return self.inner.get_image_features(pixel_values=pixel_values).pooler_output.float()
            finally:
                modeling_llama4.vision_apply_rotary_emb = before
                del rotary.forward

    def _real_rotary(query, key, freqs_ci):
        cos, sin = freqs_ci[None, :, :, :, 0], freqs_ci[None, :, :, :, 1]  # [1, N, 1, D/2] against [B, N, H, D/2]

        def rotate(x):
            pair = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pair[..., 0], pair[..., 1]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

        return rotate(query), rotate(key)

    return Llama4Encoder(hf).eval()


def example(torch, side: int) -> tuple[tuple, dict]:
    """The traced example (:data:`EXAMPLE_TILES` tiles of ``side`` pixels) and its dynamic tile count."""
    tiles = torch.export.Dim("tiles", min=1, max=MAX_TILES)
    return (torch.randn(EXAMPLE_TILES, 3, side, side),), {"pixel_values": {0: tiles}}
