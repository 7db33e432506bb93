"""Vision-language checkpoints (issue 49): what they are, and how their text model is built.

A checkpoint whose model type is in transformers' image-text-to-text mapping (``Qwen3_5ForConditionalGeneration``,
``Gemma3ForConditionalGeneration``, ``Mistral3ForConditionalGeneration``, ``Llama4ForConditionalGeneration``, ...)
is built from that wrapper class itself, with the weights named as the checkpoint stores them; the traced step is
the wrapper's own forward on text (no pixels), so the text model runs exactly as transformers runs it inside the
wrapper (its embedding scale, its M-RoPE with text positions, its final norm and head).

The vision encoder of a family whose images llmc places (``compiler/vision_encoder.py``: LLaVA, Qwen3.5 and
Qwen3-VL so far) is compiled into a second graph of the artifact; any other family's encoders (vision, audio) are
not yet: a build refuses such a checkpoint before any work unless ``--text-only`` asks for the text model alone,
which the manifest records (``multimodal``).
"""

from __future__ import annotations

from pathlib import Path

from llmc.errors import UnsupportedError

# Config fields that hold an encoder beside the text model (a present, non-null one means the checkpoint has it).
ENCODER_FIELDS = ("vision_config", "audio_config", "vision_tower_config", "audio_encoder_config", "vq_config")


def image_text_class(model_type: str) -> str | None:
    """transformers' image-text-to-text class of ``model_type`` (None: not a vision-language model type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)


def encoders(config: dict) -> list[str]:
    """The encoder sub-configs ``config`` sets (``vision_config``, ``audio_config``, ...)."""
    return [f for f in ENCODER_FIELDS if isinstance(config.get(f), dict)]


def is_wrapper(config: dict) -> bool:
    """Whether ``config`` is a vision-language wrapper llmc builds through its image-text-to-text class: its model
    type is in transformers' mapping and it nests its text model under ``text_config``."""
    return image_text_class(str(config.get("model_type"))) is not None and isinstance(config.get("text_config"), dict)


def auto_class(config: dict):
    """transformers' auto class a model of ``config`` is built with: a vision-language wrapper as itself (its weights
    named as the checkpoint stores them), any other model as a causal LM, unless transformers registers its type
    under image-text-to-text only (Mistral 4: no ``text_config``, no causal-LM class)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    only_image_text = (model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
                       and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return AutoModelForImageTextToText if is_wrapper(config) or only_image_text else AutoModelForCausalLM


def refuse_encoders(config: dict, model_type: str, cfg_path: Path, text_only: bool) -> None:
    """Refuse (exit 3) a vision-language checkpoint whose encoders would be dropped silently: without
    ``--text-only`` its encoders must be compiled, which llmc does not do yet."""
    found = encoders(config)
    if not found or text_only or not is_wrapper(config):
        return
    raise UnsupportedError(
        f"{cfg_path}: model_type {model_type!r} ({image_text_class(model_type)}) is a vision-language model: llmc "
        f"builds its text model, but does not compile its encoders ({', '.join(found)}) into the artifact yet; "
        "build with --text-only to build the text model alone (the engine then takes text, and the manifest says "
        "so)")


def refuse_other_encoders(config: dict, model_type: str, cfg_path: Path) -> None:
    """An image build compiles the vision encoder only: a checkpoint that also has an audio (or another) encoder is
    refused before any work (exit 3), naming it, rather than built with that encoder silently left out."""
    others = [f for f in encoders(config) if f != "vision_config"]
    if others:
        raise UnsupportedError(
            f"{cfg_path}: model_type {model_type!r} has {', '.join(others)} beside its vision encoder: llmc compiles "
            "the vision encoder into the artifact but not that one yet; build with --text-only for the text model "
            "alone")


def manifest_entry(config: dict) -> dict:
    """The manifest's ``multimodal`` section of a text-only build of a vision-language checkpoint."""
    model_type = str(config.get("model_type"))
    return {"wrapper": image_text_class(model_type), "text_only": True, "encoders_left_out": encoders(config),
            "text_model_type": config["text_config"].get("model_type")}
