"""Qwen3-VL's deepstack in the packed-token step: visual features added to the first layers' hidden states.

transformers' ``Qwen3VLTextModel`` adds ``deepstack_visual_embeds[i]`` to layer ``i``'s output at the image tokens
(``_deepstack_process``: a boolean mask over the batch), and its wrapper computes them only from pixel values. The
step of an image build takes each image token's features and deepstack features as one row of ``image_embeds``
(``[M, hidden * (1 + layers)]``, the encoder graph's output: compiler/qwen_vision.py); :func:`install` makes the text
model take the deepstack part at the step's ``image_rows``, adding it with the same arithmetic
(``hidden[rows] + embeds``), indexed by rows instead of a mask.
"""

from __future__ import annotations

# The current trace's deepstack features and their rows, set by the step's wrapper and taken by the text model.
STEP: dict[str, object] = {}


def layers(hf_config) -> int:
    """How many decoder layers take deepstack features (0: none)."""
    return len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or ())


def install(hf) -> None:
    """Make the wrapper's text model read the step's deepstack features (:data:`STEP`), if it has any layers."""
    text = getattr(getattr(hf, "model", None), "language_model", None)
    if text is None or not hasattr(text, "_deepstack_process") or not layers(hf.config):
        return
    forward = text.forward

    def with_step(*args, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):
        if "rows" in STEP:
            visual_pos_masks, deepstack_visual_embeds = STEP.pop("rows"), STEP.pop("embeds")
        return forward(*args, visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack_visual_embeds,
                       **kwargs)

    def add_at_rows(hidden_states, rows, visual_embeds):
        """``hidden_states`` ``[1, T, hidden]`` with ``visual_embeds`` ``[M, hidden]`` added at ``rows`` ``[M]``."""
        added = hidden_states[0, rows] + visual_embeds.to(hidden_states.dtype)
        return hidden_states.index_put((rows.new_zeros(rows.shape), rows), added)

    text.forward = with_step
    text._deepstack_process = add_at_rows


def split(image_embeds, hidden: int, rows) -> object:
    """The main part ``[M, hidden]`` of a step's ``image_embeds``; its deepstack part, one ``[M, hidden]`` per
    layer, goes to :data:`STEP` for the text model."""
    if image_embeds.shape[-1] == hidden:
        return image_embeds
    count = image_embeds.shape[-1] // hidden - 1
    deep = image_embeds[:, hidden:].reshape(-1, count, hidden)
    STEP.update(rows=rows, embeds=[deep[:, i] for i in range(count)])
    return image_embeds[:, :hidden]
