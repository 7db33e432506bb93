"""The vision encoder of a vision-language checkpoint, traced into a second graph of the artifact (issue 49 item 2).

The encoder and its projector run as transformers runs them: the wrapper's own ``get_image_features`` on pixel
values of the image processor's fixed size, traced with torch.export into ``vision_encoder`` (input
``pixel_values`` float32 ``[1, 3, H, W]``, output ``image_features`` ``[1, tokens per image, text hidden]``), its
weights bound from the checkpoint by the same binding as the text model's. The language model of such a build takes
two more inputs (:data:`IMAGE_INPUTS`): the packed step's rows whose token embedding is replaced, and what replaces
it.

Families whose images llmc places so far: :data:`IMAGE_FAMILIES` (LLaVA: image tokens at the placeholder token, 1-D
positions, causal attention; Qwen3.5: dynamic resolution, its encoder a graph over any number of patches
(compiler/qwen_vision.py), and 3-D M-RoPE positions, which its language model takes as one more input,
:data:`MROPE_POSITIONS`; Qwen3-VL: the same, plus deepstack features carried in each image row,
compiler/deepstack.py; Mistral 3: any size at whole merged patches, its encoder a graph of symbolic height and width
(compiler/pixtral_vision.py), each image laid out as rows of image tokens closed by ``[IMG_BREAK]`` / ``[IMG_END]``,
:data:`ROWS_FAMILIES`; Idefics3: each image cut into tiles plus a global image, its encoder a graph over any
number of tiles (compiler/idefics3_vision.py), laid out as Idefics3Processor writes it, :data:`TILES_FAMILIES`;
Llama 4: tiles of a best-fit canvas plus a global tile through its own ``get_image_features`` over any number of
tiles, laid out with tile separators (compiler/llama4_vision.py)).
Others build ``--text-only``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmc.compiler import deepstack
from llmc.errors import UnsupportedError

if TYPE_CHECKING:  # the build's checks import this module on cache hits too, which never load onnx_ir
    import onnx_ir as ir

    from llmc.compiler.idefics3_vision import TileLayout
    from llmc.compiler.llama4_vision import SeparatorLayout

ENCODER_GRAPH = "vision_encoder"
ENCODER_INPUT, ENCODER_OUTPUT = "pixel_values", "image_features"
IMAGE_EMBEDS, IMAGE_ROWS = "image_embeds", "image_rows"
IMAGE_INPUTS = (IMAGE_EMBEDS, IMAGE_ROWS)
# The language model's further input of an M-RoPE family: [3, T] int64 (time, height, width) positions of the step's
# tokens (transformers' get_rope_index; the runtime's llmc.runtime.mrope).
MROPE_POSITIONS = "mrope_positions"
# model type -> how its images enter the text model (what the runtime and tests rely on)
IMAGE_FAMILIES = {"llava": "image tokens at the placeholder token, 1-D positions, causal attention",
                  "qwen3_5": "dynamic resolution, image tokens at the placeholder token, 3-D M-RoPE positions, "
                             "causal attention",
                  "qwen3_vl": "dynamic resolution, image tokens at the placeholder token, 3-D M-RoPE positions, "
                              "deepstack features added to the first layers' hidden states, causal attention",
                  "gemma3": "image tokens wrapped in start/end-of-image tokens and blank lines, attending "
                            "bidirectionally among one image's tokens (attend_end)",
                  "gemma4": "any aspect within a patch budget, image tokens between start/end-of-image tokens, "
                            "attending bidirectionally among one image's tokens on sliding layers where the config "
                            "says use_bidirectional_attention 'vision'",
                  "mistral3": "any size at whole merged patches, rows of image tokens closed by [IMG_BREAK] and the "
                              "last by [IMG_END], 1-D positions, causal attention",
                  "idefics3": "tiles of a fixed size in a grid plus a global image, each tile's image tokens after "
                              "<fake_token_around_image><row_i_col_j>, 1-D positions, causal attention",
                  "llama4": "tiles of a best-fit canvas plus a global tile, patch tokens between <|image_start|> "
                            "and <|image_end|> with tile separators, beside the text model's chunked attention"}
# Families of a dynamic-resolution encoder (compiler/qwen_vision.py) whose text model takes M-RoPE positions.
MROPE_FAMILIES = ("qwen3_5", "qwen3_vl")
# Families of a dynamic-size encoder (compiler/pixtral_vision.py) whose image tokens come in rows with break tokens.
ROWS_FAMILIES = ("mistral3",)
# Families that cut an image into tiles plus a global image (compiler/idefics3_vision.py), laid out with tile tokens.
TILES_FAMILIES = ("idefics3",)
# Families whose tiles are laid out with separator tokens (Llama 4, compiler/llama4_vision.py).
SEPARATOR_FAMILIES = ("llama4",)
# Families whose image tokens attend to each other both ways (Gemma 3): the language model takes ``attend_end``
# [T] (llmc.compiler.attention_hook), and each image is wrapped in the processor's tokens (``layout: wrap``).
BIDIRECTIONAL_FAMILIES = ("gemma3", "gemma4")
# Families whose image layout names tokens only the checkpoint's tokenizer knows ("\n\n", [IMG_BREAK], ...)
TOKENIZER_LAYOUTS = ("gemma3", "mistral3", "idefics3", "llama4")
# model type -> what its images need that llmc does not lower yet (refused by name; --text-only builds the text model)
IMAGES_NOT_YET: dict[str, str] = {}


@dataclass(frozen=True)
class ImageSpec:
    """What an image build records: the placeholder token, the encoder's fixed input size (pixels) and its tokens
    per image (None for a dynamic-resolution family), the text model's width (the embeddings' last dimension), and
    for an M-RoPE family the merger's patch group side (``spatial_merge_size``)."""

    image_token_id: int
    image_size: tuple[int, int] | None
    tokens_per_image: int | None
    hidden_size: int
    merge_size: int | None = None
    position_table_side: int | None = None  # Qwen: the learned position table's side (resampled to each grid)
    deepstack_layers: int = 0  # Qwen3-VL: layers that add deepstack features (each image row: hidden * (1 + this))
    # Mistral 3: pixels per token side, and the tokens closing each row and the image ([IMG_BREAK], [IMG_END])
    token_pixels: int | None = None
    break_token_id: int | None = None
    end_token_id: int | None = None
    # Gemma 3: the prompt's placeholder (its start-of-image token) and the tokens around an image's tokens
    placeholder_token_id: int | None = None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    bidirectional: str | None = None  # which layers attend both ways within an image: "all", "sliding" or None
    tiles: TileLayout | None = None  # Idefics3: the tile layout's token ids (compiler/idefics3_vision.py)
    separators: SeparatorLayout | None = None  # Llama 4: its layout's token ids (compiler/llama4_vision.py)


def builds_images(config: dict, text_only: bool) -> bool:
    """Whether a build of ``config`` compiles its vision encoder (a family llmc places images of, not --text-only)."""
    return not text_only and config.get("model_type") in IMAGE_FAMILIES and isinstance(config.get("vision_config"),
                                                                                          dict)


def refuse_family(cfg_path: Path, model_type: str, text_only: bool) -> None:
    """A family whose images need what llmc does not lower yet (:data:`IMAGES_NOT_YET`): refused by name (exit 3)."""
    if not text_only and model_type in IMAGES_NOT_YET:
        raise UnsupportedError(f"{cfg_path}: model_type {model_type!r}: its images need {IMAGES_NOT_YET[model_type]}; "
                               "build with --text-only for the text model alone")


def refuse_options(cfg_path: Path, model_type: str, options, backend: str) -> None:
    """What an image build cannot be combined with yet, refused before any work (exit 3), naming it. ``backend``:
    the one that builds it (the CPU engine and the CUDA engine emit the encoder's graph; TensorRT does not)."""
    head = (f"{cfg_path}: model_type {model_type!r} with its vision encoder (build with --text-only for the text "
            "model alone)")
    if backend not in ("onnxruntime", "cuda"):
        raise UnsupportedError(f"{head}: the {backend} backend emits no encoder graph yet; build the CUDA engine "
                               "(leave --engine out) or --target cpu")
    if options.verify_passes:
        raise UnsupportedError(f"{head}: --verify-passes is not combined with image inputs yet; build without "
                               "--verify-passes")


def rows_family(model_type: str) -> bool:
    """Whether an image build of ``model_type`` lays out its image tokens in rows with break tokens (Mistral 3)."""
    return model_type in ROWS_FAMILIES


def bidirectional_images(model_type: str, config: dict) -> str | None:
    """Which layers of an image build of ``config`` attend bidirectionally among an image's tokens (``attend_end``):
    ``"all"`` (Gemma 3), ``"sliding"`` (Gemma 4 with ``use_bidirectional_attention: "vision"``: its global layers
    stay causal), or None."""
    if model_type == "gemma3":
        return "all"
    if model_type == "gemma4" and (config.get("text_config") or {}).get("use_bidirectional_attention") == "vision":
        return "sliding"
    return None


def needs_tokenizer(model_type: str) -> bool:
    """Whether the image layout of ``model_type`` names tokens read from the checkpoint's tokenizer."""
    return model_type in TOKENIZER_LAYOUTS


def wrap_family(model_type: str) -> bool:
    """Whether ``model_type`` wraps each image's tokens in start/end tokens (``layout: wrap``)."""
    return model_type in BIDIRECTIONAL_FAMILIES


def uses_mrope(model_type: str) -> bool:
    """Whether an image build of ``model_type`` takes M-RoPE positions (:data:`MROPE_POSITIONS`)."""
    return model_type in MROPE_FAMILIES


def trace_size(model_type: str, config, checkpoint: Path) -> tuple[int, int]:
    """The (height, width) in pixels the encoder is traced at: a fixed-size family's only size, a
    dynamic-resolution family's example (its graph takes any)."""
    if uses_mrope(model_type):
        from llmc.compiler.qwen_vision import EXAMPLE_GRID

        return EXAMPLE_GRID[1] * config.patch_size, EXAMPLE_GRID[2] * config.patch_size
    if model_type in ROWS_FAMILIES:
        from llmc.compiler.pixtral_vision import EXAMPLE_GRID as ROWS_GRID

        side = int(config.patch_size if isinstance(config.patch_size, int) else config.patch_size["height"])
        return ROWS_GRID[0] * side, ROWS_GRID[1] * side
    if model_type in TILES_FAMILIES:  # one tile: the encoder takes any number of them
        tile = int(config.max_image_size["longest_edge"])
        return tile, tile
    if model_type in SEPARATOR_FAMILIES:
        return int(config.size["height"]), int(config.size["width"])
    if model_type == "gemma4":  # (patch budget, 1): the encoder takes the processor's padded patches
        return int(config.max_soft_tokens) * int(config.pooling_kernel_size) ** 2, 1
    if getattr(config, "do_pan_and_scan", False):
        raise UnsupportedError(f"{checkpoint}: the image processor's do_pan_and_scan (crops of an elongated image, "
                               "each its own image in the prompt) is not reproduced by llmc's image layout yet; set "
                               "it false in preprocessor_config.json")
    return fixed_size(config, checkpoint)


def fixed_size(config, checkpoint: Path) -> tuple[int, int]:
    """The (height, width) in pixels every image has after ``config`` (an ImageProcessorConfig of a fixed-size
    family: its centre crop, else its resize to a height and width)."""
    for size, on in ((config.crop_size, config.do_center_crop), (config.size, config.do_resize)):
        if on and size and "height" in size and "width" in size:
            return int(size["height"]), int(size["width"])
    raise UnsupportedError(f"{checkpoint}: the image processor gives images no fixed size (size {config.size}, crop "
                           f"{config.crop_size}); llmc's LLaVA encoder graph takes one size")


def spec_of(hf_config, processor_size: tuple[int, int], checkpoint: Path) -> ImageSpec:
    """The image build's figures from the wrapper's config (LLaVA: patches per side squared, the CLS token dropped
    by the ``default`` feature selection; Qwen and Mistral 3: tokens per image vary with its size)."""
    vision = hf_config.vision_config
    if hf_config.model_type in ROWS_FAMILIES:
        from llmc.compiler import pixtral_vision

        brk, end = pixtral_vision.layout_tokens(checkpoint)
        return ImageSpec(int(hf_config.image_token_id), None, None, int(hf_config.get_text_config().hidden_size),
                         token_pixels=pixtral_vision.token_pixels(hf_config), break_token_id=brk, end_token_id=end)
    if hf_config.model_type in TILES_FAMILIES:
        from llmc.compiler import idefics3_vision
        from llmc.runtime.vision import processor_for, read_checkpoint_json

        raw = idefics3_vision.processor_json(read_checkpoint_json(checkpoint), hf_config.to_dict())
        tiles = idefics3_vision.layout(processor_for(hf_config.model_type, raw).config, checkpoint)
        return ImageSpec(int(hf_config.image_token_id), processor_size, None,
                         int(hf_config.get_text_config().hidden_size), tiles=tiles)
    if hf_config.model_type in SEPARATOR_FAMILIES:
        from llmc.compiler import llama4_vision

        return ImageSpec(int(hf_config.image_token_id), processor_size, None,
                         int(hf_config.get_text_config().hidden_size), separators=llama4_vision.layout(checkpoint))
    if uses_mrope(hf_config.model_type):
        return ImageSpec(int(hf_config.image_token_id), None, None, int(hf_config.get_text_config().hidden_size),
                         int(vision.spatial_merge_size), int(vision.num_position_embeddings ** 0.5),
                         deepstack.layers(hf_config))
    hidden = int(hf_config.get_text_config().hidden_size)
    if hf_config.model_type == "gemma3":  # "\n\n<boi>" + soft tokens + "<eoi>\n\n"
        blank = blank_line_tokens(checkpoint)
        return ImageSpec(int(hf_config.image_token_id), processor_size, int(hf_config.mm_tokens_per_image), hidden,
                         placeholder_token_id=int(hf_config.boi_token_id), prefix=(*blank, int(hf_config.boi_token_id)),
                         suffix=(int(hf_config.eoi_token_id), *blank), bidirectional="all")
    if hf_config.model_type == "gemma4":  # "<boi>" + soft tokens (as many as the image's size gives) + "<eoi>"
        return ImageSpec(int(hf_config.image_token_id), None, None, hidden,
                         placeholder_token_id=int(hf_config.image_token_id), prefix=(int(hf_config.boi_token_id),),
                         suffix=(int(hf_config.eoi_token_id),),
                         bidirectional=bidirectional_images("gemma4", hf_config.to_dict()))
    patches = (processor_size[0] // vision.patch_size) * (processor_size[1] // vision.patch_size)
    tokens = patches + (0 if hf_config.vision_feature_select_strategy == "default" else 1)
    return ImageSpec(int(hf_config.image_token_id), processor_size, tokens,
                     int(hf_config.get_text_config().hidden_size))


def encoder_module(torch, hf):
    """The wrapper's ``get_image_features`` as a module of pixel values (``inner`` is the wrapper, so its parameters
    carry the same ``inner.`` prefix as the text model's)."""

    class VisionEncoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values):
            cfg = self.inner.config
            # LLaVA-style wrappers select a layer and drop the CLS token; Gemma 3's takes pixels alone
            select = {k: getattr(cfg, k) for k in ("vision_feature_layer", "vision_feature_select_strategy")
                      if hasattr(cfg, k)}
            out = self.inner.get_image_features(pixel_values=pixel_values, **select)
            feats = out.pooler_output
            return (torch.stack(list(feats)) if isinstance(feats, list | tuple) else feats).float()

    return VisionEncoder(hf).eval()


def trace(torch, hf, size: tuple[int, int], opset: int, bind: Callable[[ir.Model, object], None]) -> ir.Model:
    """torch.onnx.export (dynamo) of the encoder on one image's ``[1, 3, H, W]`` pixels (the runtime encodes each
    image on its own, as it caches each by its content; get_image_features' per-image list fixes the count);
    ``bind`` gives the graph's initializers their checkpoint tensors. The vision tower runs transformers' eager
    attention (the text model's attention hook is for the paged text attention only). Qwen's encoder: its own module,
    inputs and dynamic patch count (compiler/qwen_vision.py)."""
    vision = hf.config.vision_config
    before = vision._attn_implementation
    if hf.config.model_type == "gemma4":
        from llmc.compiler import gemma4_vision

        module, names = gemma4_vision.encoder_module(torch, hf), list(gemma4_vision.ENCODER_INPUTS)
        example, dynamic = gemma4_vision.example(torch, hf, size[0])
        vision._attn_implementation = "eager"
    elif hf.config.model_type in TILES_FAMILIES:
        from llmc.compiler import idefics3_vision

        module = idefics3_vision.encoder_module(torch, hf)
        (example, dynamic), names = idefics3_vision.example(torch, size[0]), list(idefics3_vision.ENCODER_INPUTS)
        vision._attn_implementation = "eager"
    elif hf.config.model_type in SEPARATOR_FAMILIES:
        from llmc.compiler import llama4_vision

        module = llama4_vision.encoder_module(torch, hf)
        (example, dynamic), names = llama4_vision.example(torch, size[0]), list(llama4_vision.ENCODER_INPUTS)
        vision._attn_implementation = "eager"
    elif hf.config.model_type in ROWS_FAMILIES:
        from llmc.compiler import pixtral_vision

        pixtral_vision.check_layout(hf)
        module = pixtral_vision.encoder_module(torch, hf)
        (example, dynamic), names = pixtral_vision.example(torch, hf), list(pixtral_vision.ENCODER_INPUTS)
        vision._attn_implementation = "eager"
    elif uses_mrope(hf.config.model_type):
        from llmc.compiler import qwen_vision

        qwen_vision.check_layout(hf.model.visual)
        qwen_vision.register()
        module = qwen_vision.encoder_module(torch, hf)
        (example, dynamic), names = qwen_vision.example(torch, hf), list(qwen_vision.ENCODER_INPUTS)
        vision._attn_implementation = qwen_vision.VISION_ATTENTION
    else:
        module, example, dynamic, names = encoder_module(torch, hf), (torch.zeros(1, 3, *size),), None, [ENCODER_INPUT]
        vision._attn_implementation = "eager"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, example, input_names=names, output_names=[ENCODER_OUTPUT], dynamic_shapes=dynamic,
                dynamo=True, opset_version=opset, optimize=False, verbose=False)
    finally:
        vision._attn_implementation = before
    model = program.model
    bind(model, module)
    return model


def manifest_entry(wrapper: str | None, spec: ImageSpec, processor_file: str) -> dict:
    """The manifest's ``multimodal`` section of an image build."""
    entry = {"wrapper": wrapper, "text_only": False, "encoder_graph": ENCODER_GRAPH,
             "image_token_id": spec.image_token_id, "tokens_per_image": spec.tokens_per_image,
             "image_size": list(spec.image_size) if spec.image_size else None, "hidden_size": spec.hidden_size,
             "processor_file": processor_file, "prefix_cache": "blocks keyed by the images' content"}
    if spec.merge_size is not None:  # dynamic resolution, M-RoPE (llmc.runtime.mrope)
        entry.update(positions="mrope", merge_size=spec.merge_size, position_table_side=spec.position_table_side,
                     deepstack_layers=spec.deepstack_layers)
    if spec.placeholder_token_id is not None:  # tokens around each image's (llmc.runtime.image_inputs)
        entry.update(layout="wrap", placeholder_token_id=spec.placeholder_token_id, image_prefix=list(spec.prefix),
                     image_suffix=list(spec.suffix), bidirectional=spec.bidirectional)
    if spec.token_pixels is not None:  # rows of image tokens with break tokens (llmc.runtime.image_inputs)
        entry.update(layout="rows", token_pixels=spec.token_pixels, image_break_token_id=spec.break_token_id,
                     image_end_token_id=spec.end_token_id)
    if spec.tiles is not None:  # tiles and a global image, each after its tokens (llmc.runtime.image_inputs)
        entry.update(layout="tiles", **spec.tiles.as_manifest())
    if spec.separators is not None:  # tiles between separator tokens; the placeholder is <|image|>
        entry.update(layout="separators", placeholder_token_id=spec.separators.image, **spec.separators.as_manifest())
    return entry


def blank_line_tokens(checkpoint: Path) -> tuple[int, ...]:
    """The ids of ``"\n\n"`` in the checkpoint's tokenizer: Gemma3Processor writes a blank line before and after
    each image's tokens, and the runtime lays an image out at the token level."""
    from llmc.runtime.tokenizer import Tokenizer

    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedError(f"{checkpoint}: Gemma 3 wraps each image's tokens in blank lines, whose tokens llmc "
                               "reads from the checkpoint's tokenizer.json, which is missing; add the tokenizer files "
                               "the checkpoint was published with, or build with --text-only")
    return tuple(int(t) for t in Tokenizer(checkpoint).encode("\n\n", add_special_tokens=False))
