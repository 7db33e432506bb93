"""Mistral 3's vision encoder (Pixtral tower, patch merger, projector) as one graph over any image size (issue 49).

Mistral 3 keeps each image's aspect ratio: the processor resizes it to whole merged patches (``patch_size *
spatial_merge_size`` pixels) and the encoder runs on exactly those pixels. transformers' ``get_image_features``
splits its output per image with ``.tolist()`` and its patch merger loops over images; the runtime encodes one image
per call (each is cached by its content), so this module runs the same modules on one image whose height and width
stay symbolic: the tower (patch convolution, ``ln_pre``, 2-D axial rotary of every patch's (row, column), the
blocks), the feature layer the config selects, the projector's norm, the merger's ``unfold`` of merge x merge
patch groups, and its two linears. Output: ``[1, rows * columns, text hidden]`` in the merged grid's row-major
order, which the runtime lays out as the processor's ``[IMG]`` rows, each closed by ``[IMG_BREAK]`` and the last by
``[IMG_END]`` (llmc.runtime.image_inputs).
"""

from __future__ import annotations

from pathlib import Path

from llmc.errors import UnsupportedError

ENCODER_INPUTS = ("pixel_values",)
EXAMPLE_GRID = (2, 3)  # the traced example in merged tokens (rows, columns); any size runs


def token_pixels(hf_config) -> int:
    """Pixels per image token on each side: the tower's patch times the merger's group side."""
    return int(hf_config.vision_config.patch_size) * int(hf_config.spatial_merge_size)


def encoder_module(torch, hf):
    """``pixel_values [1, 3, H, W]`` (H, W multiples of :func:`token_pixels`) to ``image_features [1, H*W /
    token_pixels², text hidden]`` through the wrapper's own modules (``inner`` is the wrapper: parameters named as
    the text model's)."""

    class PixtralEncoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            model = self.inner.model
            height, width = pixel_values.shape[-2], pixel_values.shape[-1]
            out = model.vision_tower(pixel_values, image_sizes=[(height, width)], output_hidden_states=True)
            layer = self.inner.config.vision_feature_layer
            feats = out.hidden_states[layer] if isinstance(layer, int) else torch.cat(
                [out.hidden_states[i] for i in layer], dim=-1)
            projected = model.multi_modal_projector(feats.squeeze(0), [(height, width)])
            return projected[None].float()

    return PixtralEncoder(hf).eval()


def example(torch, hf) -> tuple[tuple, dict]:
    """The traced example (one :data:`EXAMPLE_GRID` image of random pixels) and its dynamic height and width."""
    side = token_pixels(hf.config)
    rows = torch.export.Dim("token_rows", min=1, max=1024) * side
    cols = torch.export.Dim("token_columns", min=1, max=1024) * side
    pixels = torch.randn(1, 3, EXAMPLE_GRID[0] * side, EXAMPLE_GRID[1] * side)
    return (pixels,), {"pixel_values": {2: rows, 3: cols}}


def check_layout(hf) -> None:
    """What this graph and the runtime reproduce: the axial 2-D rotary and one token per merged patch group."""
    vision = hf.config.vision_config
    rope = (getattr(vision, "rope_parameters", None) or {}).get("rope_type", "axial")
    if rope != "axial":
        raise UnsupportedError(f"{type(hf.model.vision_tower).__name__}: rotary {rope!r} is not lowered by llmc's "
                               "Mistral 3 encoder graph (axial 2-D rotary only)")


BREAK_TOKEN, END_TOKEN = "[IMG_BREAK]", "[IMG_END]"  # PixtralProcessor's defaults


def layout_tokens(checkpoint: Path) -> tuple[int, int]:
    """The ids of the tokens closing each image row and the image: their names from the checkpoint's
    ``processor_config.json`` (PixtralProcessor's ``image_break_token`` / ``image_end_token``, else its defaults),
    their ids from its tokenizer (``tokenizer.json``'s added tokens or vocabulary, or ``tokenizer_config.json``'s
    ``added_tokens_decoder``)."""
    names = _read(checkpoint / "processor_config.json")
    wanted = (str(names.get("image_break_token") or BREAK_TOKEN), str(names.get("image_end_token") or END_TOKEN))
    ids: dict[str, int] = {}
    tok = _read(checkpoint / "tokenizer.json")
    for entry in tok.get("added_tokens") or ():
        ids.setdefault(str(entry.get("content")), int(entry["id"]))
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        for name in wanted:
            if name in vocab:
                ids.setdefault(name, int(vocab[name]))
    for key, entry in (_read(checkpoint / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
        ids.setdefault(str(entry.get("content")), int(key))
    missing = [n for n in wanted if n not in ids]
    if missing:
        raise UnsupportedError(
            f"{checkpoint}: Mistral 3 lays out an image's tokens in rows closed by {' and '.join(wanted)}, but the "
            f"checkpoint's tokenizer (tokenizer.json / tokenizer_config.json) has no {', '.join(missing)}; add the "
            "tokenizer files the checkpoint was published with, or build with --text-only")
    return ids[wanted[0]], ids[wanted[1]]


def _read(path: Path) -> dict:
    import json

    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedError(f"{path}: not readable JSON ({e}); restore the file from the checkpoint") from e
    return data if isinstance(data, dict) else {}
