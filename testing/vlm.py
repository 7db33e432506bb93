"""Tiny random vision-language checkpoints of the wrappers the 2026 flagships ship as (issue 49).

Each is made from transformers' own config and ``AutoModelForImageTextToText`` class of its model type, with the
released models' layer order at small widths (Qwen3.5: linear-attention layers before a full-attention one; Gemma 3
and 4: sliding layers before a global one; Llama 4: MoE layers), and saved with ``save_pretrained`` (the tensor
names the hub's checkpoints carry). Weights are drawn wider than transformers' initializer so that greedy tokens
are not decided by near-ties.
"""

from __future__ import annotations

from pathlib import Path

_T = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_V = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
_QWEN_VISION = dict(hidden_size=32, intermediate_size=64, depth=2, num_heads=2, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2)
# Qwen's image, video and vision start/end tokens inside the tiny vocabulary (the released ones are past it)
_QWEN_TOKENS = dict(vision_start_token_id=500, vision_end_token_id=501, image_token_id=502, video_token_id=503)

# model type -> (config fields, what the family's text model has that matters)
VLM_CONFIGS: dict[str, tuple[dict, str]] = {
    "qwen3_5": (dict(text_config=dict(_T, num_hidden_layers=4,
                                      layer_types=["linear_attention"] * 3 + ["full_attention"],
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                      linear_value_head_dim=16, linear_conv_kernel_dim=4),
                     vision_config=_QWEN_VISION, **_QWEN_TOKENS),
                "Gated DeltaNet layers then a full-attention layer, M-RoPE"),
    "qwen3_vl": (dict(text_config=dict(_T, rope_scaling=dict(rope_type="default", mrope_section=[2, 3, 3],
                                                             mrope_interleaved=True)),
                      vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]), **_QWEN_TOKENS),
                 "interleaved M-RoPE, deepstack"),
    "gemma3": (dict(text_config=dict(_T, num_hidden_layers=3, sliding_window=16,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
                    vision_config=dict(_V, image_size=64, patch_size=16), mm_tokens_per_image=4,
                    boi_token_index=500, eoi_token_index=501, image_token_index=502),
               "sliding + global layers, (1 + w) norms, scaled embeddings"),
    "gemma4": (dict(text_config=dict(_T, num_hidden_layers=3, sliding_window=16, global_head_dim=32,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                                     use_bidirectional_attention="vision"),
                    vision_config=dict(_V, head_dim=16, num_key_value_heads=2), boi_token_id=500, eoi_token_id=501,
                    image_token_id=502,
                    video_token_id=503, boa_token_id=504,
                    eoa_token_index=505, audio_token_id=506),
               "per-layer head sizes, per-layer input embeddings"),
    "mistral3": (dict(text_config=dict(_T, model_type="mistral"),
                      vision_config=dict(_V, model_type="pixtral", head_dim=16, image_size=128, patch_size=16),
                      image_token_index=502),
                 "Mistral text model"),
    "llama4": (dict(text_config=dict(_T, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1,
                                     interleave_moe_layer_step=1, attention_chunk_size=16),
                    vision_config=dict(_V, intermediate_size=128, image_size=64, patch_size=16, vision_output_dim=64,
                                       projector_input_dim=64, projector_output_dim=64),
                    image_token_index=502),
               "MoE layers, chunked local attention, NoPE layers"),
    "llava": (dict(text_config=dict(_T, model_type="llama"),
                   vision_config=dict(_V, model_type="clip_vision_model", image_size=64, patch_size=16,
                                      projection_dim=32),
                   image_token_index=502),
              "Llama text model behind a CLIP encoder"),
    "idefics3": (dict(text_config=dict(_T, model_type="llama"), vision_config=dict(_V, image_size=64, patch_size=16),
                      image_token_id=502),
                 "Llama text model behind a SigLIP encoder with pixel shuffle"),
}


def _centred(module) -> bool:
    from llmc.testing.hybrids import _scales_by_one_plus_weight

    return _scales_by_one_plus_weight(module)


def write_tiny_vlm(model_type: str, out: str | Path, *, seed: int = 0, std: float = 0.15):
    """Write a random tiny ``model_type`` vision-language checkpoint to ``out``; returns the transformers model
    (float32, eval). Matrices ~ N(0, std) (embeddings 0.08), norms around 1 (around 0 where they scale by
    ``1 + weight``)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    fields, _ = VLM_CONFIGS[model_type]
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    hf = AutoModelForImageTextToText.from_config(cfg).eval()
    centred = {id(m.weight) for m in hf.modules() if _centred(m)}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" in name else std)
            elif id(p) in centred:
                p.uniform_(-0.2, 0.2)
            elif not name.endswith(("A_log", "dt_bias")):
                p.uniform_(0.8, 1.2)
    hf.save_pretrained(out)
    return hf


def text_greedy(hf, prompts, new_tokens: int) -> list[list[int]]:
    """The multimodal model's own greedy continuation of each text-only prompt (alone, no EOS)."""
    import torch

    refs = []
    for p in prompts:
        with torch.no_grad():
            refs.append(hf.generate(input_ids=torch.tensor([list(p)]), max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist())
    return refs


# model type -> (transformers' PIL image processor class, its settings at the tiny encoder's image size)
VLM_PROCESSORS: dict[str, tuple[str, dict]] = {
    "llava": ("CLIPImageProcessorPil", dict(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})),
    # the tiny encoder's 16-pixel patches merged 2x2; 4 to 64 image tokens
    **dict.fromkeys(("qwen3_5", "qwen3_vl"), ("Qwen2VLImageProcessorPil", dict(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256}))),
    # PixtralImageProcessor at the tower's 16-pixel patches; Mistral 3's processor resizes to whole 2x2 merged
    # patches (32 pixels) and lays each image out in rows of [IMG] closed by [IMG_BREAK] / [IMG_END]
    "gemma3": ("Gemma3ImageProcessorPil", dict(size={"height": 64, "width": 64})),
    # the smallest soft-token budget (70 = 630 patches of 16 pixels, pooled 3x3)
    "gemma4": ("Gemma4ImageProcessorPil", dict(patch_size=16, max_soft_tokens=70, pooling_kernel_size=3)),
    "mistral3": ("PixtralImageProcessorPil", dict(size={"longest_edge": 128}, patch_size={"height": 16, "width": 16})),
    # Idefics3's tiles are the tiny tower's 64-pixel images; every image's longest edge resized to 192: 3 tiles
    # along it, 1 to 3 along the other, plus the global image
    "idefics3": ("Idefics3ImageProcessorPil", dict(size={"longest_edge": 192}, max_image_size={"longest_edge": 64},
                                                   do_image_splitting=True)),
}
# Mistral 3's image, row-break and image-end tokens inside the tiny vocabulary (tokenizer.json of the fixture)
PIXTRAL_TOKENS = {"[IMG]": 502, "[IMG_BREAK]": 503, "[IMG_END]": 504}


def write_processor(model_type: str, out: str | Path):
    """Save transformers' own image processor of ``model_type`` beside a tiny checkpoint (its
    ``preprocessor_config.json``); returns it. The PIL processors: torchvision is not installed beside the CPU torch."""
    import transformers

    name, settings = VLM_PROCESSORS[model_type]
    processor = getattr(transformers, name)(**settings)
    processor.save_pretrained(out)
    if model_type == "mistral3":
        write_word_tokenizer(out, 512, PIXTRAL_TOKENS)
    if model_type == "idefics3":
        write_idefics3_tokenizer(out)
    return processor


# Llama4Processor's tokens in the tiny vocabulary from id 480; <|patch|> (the image token) at 502
LLAMA4_TOKENS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]
# Llama4ImageProcessor's settings at the tiny tower's 64-pixel tiles: canvases of up to 4 tiles
LLAMA4_PROCESSOR = {"image_processor_type": "Llama4ImageProcessor", "size": {"height": 64, "width": 64},
                    "max_patches": 4, "resize_to_max_canvas": False, "resample": 2, "do_resize": True,
                    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}


def write_llama4_processor(out: str | Path, tokens: list[str] | None = None):
    """Llama4ImageProcessor's ``preprocessor_config.json`` (:data:`LLAMA4_PROCESSOR`, written as its
    ``save_pretrained`` would: transformers' class needs torchvision, which cannot be installed beside the CPU
    torch) and a tokenizer with Llama4Processor's ``tokens``; returns llmc's processor of that JSON."""
    import json

    from llmc.runtime.vision import processor_for

    (Path(out) / "preprocessor_config.json").write_text(json.dumps(LLAMA4_PROCESSOR, indent=2) + "\n")
    write_layout_tokenizer(out, list(LLAMA4_TOKENS if tokens is None else tokens), "<|patch|>")
    return processor_for("llama4", LLAMA4_PROCESSOR)


# Idefics3Processor's tokens in the tiny vocabulary, in id order: the fake token, the global image's tag and the
# tile tags of the processor's largest grid (3x3), then fillers up to the config's image token, 502
IDEFICS3_GRID = 3
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>",
                   *(f"<row_{i + 1}_col_{j + 1}>" for i in range(IDEFICS3_GRID) for j in range(IDEFICS3_GRID)),
                   "<end_of_utterance>"]


def write_idefics3_tokenizer(out: str | Path, tokens: list[str] | None = None) -> None:
    """A byte-level BPE tokenizer of 480 tokens plus Idefics3Processor's special ``tokens`` (default
    :data:`IDEFICS3_TOKENS`) from id 480, ``"\\n\\n"`` (one token, as in the released tokenizers: the layout's
    last tile row ends in it, not in two ``"\\n"``), fillers, and ``<image>`` at 502 (the tiny config's
    image_token_id)."""
    write_layout_tokenizer(out, list(IDEFICS3_TOKENS if tokens is None else tokens), "<image>", plain=["\n\n"])


def write_layout_tokenizer(out: str | Path, tokens: list[str], image: str, plain: list[str] = ()) -> None:
    """A byte-level BPE tokenizer of 480 tokens, then the special ``tokens`` and the ``plain`` added tokens in
    order from id 480, fillers, and ``image`` at 502 (the tiny configs' image token id)."""
    from tokenizers import AddedToken

    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer(vocab_size=480, model_max_length=512)
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    if plain:
        tok.add_tokens([AddedToken(t, normalized=False) for t in plain])
    fillers = [f"<unused_{i}>" for i in range(502 - len(tok))]
    tok.add_special_tokens({"additional_special_tokens": [*fillers, image]}, replace_extra_special_tokens=False)
    assert tok.convert_tokens_to_ids(image) == 502
    save_tokenizer(tok, out)


def idefics3_processor(checkpoint: str | Path, image_processor):
    """transformers' Idefics3Processor of a tiny checkpoint: its image processor and tokenizer, image_seq_len the
    model's (``(image_size / patch_size)² / scale_factor²``)."""
    from transformers import AutoConfig, AutoTokenizer, Idefics3Processor

    cfg = AutoConfig.from_pretrained(checkpoint)
    seq = int((cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2 / cfg.scale_factor ** 2)
    return Idefics3Processor(image_processor, AutoTokenizer.from_pretrained(checkpoint), image_seq_len=seq)


def write_word_tokenizer(out: str | Path, vocab_size: int, special: dict[str, int]) -> None:
    """A word-level ``tokenizer.json`` of ``vocab_size`` tokens (``t<id>``), ``special`` tokens at their ids: the
    file a checkpoint's processor finds its special tokens' ids in."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    names = {i: n for n, i in special.items()}
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(n, special=True) for n in special])
    tok.save(str(Path(out) / "tokenizer.json"))


def random_image(rng, size: tuple[int, int] = (48, 80)) -> bytes:
    """A fresh random RGB image ``size`` (height, width) as PNG bytes: smooth gradients plus noise."""
    import io

    import numpy as np
    from PIL import Image

    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    base = rng.uniform(0, 255, 3) + rng.uniform(-2, 2, 3) * (x[..., None] + y[..., None])
    pixels = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def greedy_with_logprobs(hf, input_ids, new_tokens: int, **inputs) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``input_ids`` (``[1, T]``: a tensor or a nested list) with the
    multimodal ``inputs`` (pixel values, ...), no EOS, and each chosen token's log-probability."""
    import torch

    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]


def assert_same_greedy(out, ref, atol: float = 1e-4) -> None:
    """An engine's output (``logprobs=0``) has transformers' greedy tokens and their log-probabilities within
    ``atol``."""
    import numpy as np

    tokens, lps = ref
    assert out.token_ids == tokens
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
    np.testing.assert_allclose(got, lps, atol=atol, rtol=0)
