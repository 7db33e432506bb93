"""Qwen's vision encoder (Qwen3.5, Qwen3-VL) as one graph over a variable number of patches (issue 49 item 2).

transformers' ``Qwen3_5VisionModel`` derives four tensors from ``image_grid_thw`` with loops and ``.tolist()``
(the learned position table's bilinear taps, the 2-D rotary's (row, column) of every patch, the attention's
``cu_seqlens`` and ``max_seqlen``) and takes each precomputed through its ``kwargs`` (transformers.vision_utils),
so the graph takes the first two as inputs, computed by the runtime in numpy (llmc.runtime.vision.qwen_grid), and
everything else (patch embedding, position embedding, the blocks with their 2-D rotary, the merger) runs as
transformers' own modules. The patch count stays symbolic (a multiple of merge², the merger's groups): one graph
for every image size.

The runtime encodes one image per call (each is cached by its content), so the blocks' attention spans all the
patches of the call: what transformers computes per image. The encoder's attention is registered under
:data:`VISION_ATTENTION`, a name transformers takes for a varlen (flash) kernel, so that it skips the per-image
``split(cu_seqlens.tolist())`` that no graph can hold; it runs transformers' own eager attention of the module.
"""

from __future__ import annotations

import sys

ENCODER_INPUTS = ("pixel_values", "interp_indices", "interp_weights", "vision_positions")
VISION_ATTENTION = "llmc_flash_vision_one_image"
EXAMPLE_GRID = (1, 4, 6)  # the traced example (grid_t, grid_h, grid_w) in patches; any size runs


def _one_image_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Non-causal attention over every patch of the call (one image): the module's own eager attention."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, None, scaling=scaling, dropout=0.0)


def register() -> None:
    """Make :func:`_one_image_attention` transformers' attention named :data:`VISION_ATTENTION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION, _one_image_attention)


def encoder_module(torch, hf):
    """The wrapper's vision model as a module of ``(pixel_values [N, C*T*P*P], interp_indices [N, 4] int64,
    interp_weights [N, 4] float32, vision_positions [N, 2] int64)`` to ``image_features [1, N / merge², text
    hidden * (1 + deepstack layers)]`` (``inner`` is the wrapper: parameters named as the text model's)."""

    class QwenVisionEncoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values, interp_indices, interp_weights, vision_positions):
            visual = self.inner.model.visual
            out = visual(pixel_values.to(visual.dtype), grid_thw=None, interp_indices=interp_indices,
                         interp_weights=interp_weights, position_ids=vision_positions,
                         cu_seqlens=torch.zeros(2, dtype=torch.int32), max_seqlen=1)
            # Qwen3-VL: each token's deepstack features beside its own (compiler/deepstack.py)
            deep = list(getattr(out, "deepstack_features", None) or ())
            return torch.cat([out.pooler_output, *deep], dim=-1)[None].float()

    return QwenVisionEncoder(hf).eval()


def example(torch, hf) -> tuple[tuple, dict]:
    """The traced example inputs (one :data:`EXAMPLE_GRID` image) and their dynamic dimensions."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    visual, vision = hf.model.visual, hf.config.vision_config
    merge = int(vision.spatial_merge_size)
    grid = torch.tensor([EXAMPLE_GRID])
    patches = int(grid.prod())
    width = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    positions = get_vision_position_ids(grid, merge)
    n = torch.export.Dim("merged_patches", min=1) * (merge * merge)
    dynamic = {name: {0: n} for name in ENCODER_INPUTS}
    return (torch.zeros(patches, width), indices, weights.float(), positions), dynamic


def check_layout(visual) -> None:
    """What the runtime's numpy half reproduces: bilinear taps with aligned corners (llmc.runtime.vision.qwen_grid)."""
    from llmc.errors import UnsupportedError

    if visual.interpolation_mode != "bilinear" or not visual.interpolation_align_corners:
        raise UnsupportedError(f"{type(visual).__name__}: position-table interpolation {visual.interpolation_mode!r} "
                               f"(align_corners={visual.interpolation_align_corners}) is not reproduced by llmc's "
                               "runtime; it does bilinear with aligned corners")
