"""Gemma 4's vision encoder as one graph over the processor's fixed patch budget (issue 49).

Gemma4ImageProcessor resizes each image into a budget of patches (``max_soft_tokens * pooling²``), pads the
flattened patches to that budget and marks the padding's positions (-1, -1). transformers' vision model then pools
``pooling x pooling`` patch groups into soft tokens by their positions and drops the padded ones with a boolean
index (a data-dependent shape no graph holds). The padding's soft tokens are the last rows of the pooled output
(a group's row is ``x // k + (width // k) * (y // k)``, the image's groups first), and every later step is row-wise,
so this module runs the same modules on the padded budget and keeps every row: output ``[1, max_soft_tokens, text
hidden]``; the runtime takes the image's first ``num_soft_tokens_per_image`` rows (llmc.runtime.image_inputs).
"""

from __future__ import annotations

ENCODER_INPUTS = ("pixel_values", "pixel_position_ids")


def encoder_module(torch, hf):
    """``(pixel_values [1, budget, P*P*3], pixel_position_ids [1, budget, 2] int64)`` to ``image_features [1,
    budget / pooling², text hidden]`` through the wrapper's own modules (``inner`` is the wrapper: parameters named
    as the text model's)."""

    class Gemma4VisionEncoder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, pixel_values, pixel_position_ids):
            model = self.inner.model
            tower = model.vision_tower
            k = int(tower.config.pooling_kernel_size)
            padding = (pixel_position_ids == -1).all(dim=-1)
            embeds = tower.patch_embedder(pixel_values, pixel_position_ids, padding)
            out = tower.encoder(inputs_embeds=embeds, attention_mask=~padding, pixel_position_ids=pixel_position_ids)
            hidden, _ = tower.pooler(hidden_states=out.last_hidden_state, pixel_position_ids=pixel_position_ids,
                                     padding_positions=padding, output_length=pixel_values.shape[-2] // (k * k))
            if tower.config.standardize:
                hidden = (hidden - tower.std_bias.float()) * tower.std_scale.float()
            hidden = hidden.to(embeds.dtype)
            return model.embed_vision(inputs_embeds=hidden).float()

    return Gemma4VisionEncoder(hf).eval()


def example(torch, hf, budget: int) -> tuple[tuple, None]:
    """The traced example: one image filling ``budget`` patches' first rows, the rest padding (a fixed shape)."""
    vision = hf.config.vision_config
    width = 3 * int(vision.patch_size) ** 2
    k = int(vision.pooling_kernel_size)
    side = k * 2  # a 6 x 6 patch image at pooling 3: 4 soft tokens, then padding
    xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(-1, 2)
    positions = torch.full((1, budget, 2), -1, dtype=torch.long)
    positions[0, : len(xy)] = xy
    return (torch.rand(1, budget, width), positions), None
