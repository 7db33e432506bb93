"""Quantized builds of vision-language checkpoints with their encoders (issue 49): the language model quantized
(RTN int4, calibrated fp8 through the wrapper's own class), the encoder graph kept in the compute dtype, and the
accuracy report scoring image prompts beside held-out text (quant/image_prompts.py) within the bounds text models
meet (tests/test_quant_build.py, tests/test_hybrid_quant.py: int4 KL < 1, fp8 KL < 0.25 and top-1 > 0.5)."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.quant.image_prompts import synthetic_images
from llmc.quant.recipe import QuantRecipe
from llmc.runtime import Engine, SamplingParams
from llmc.testing.vlm import random_image, write_processor, write_tiny_vlm

pytest.importorskip("torch")
IMAGE = 502


def _checkpoint(tmp_path, model_type: str):
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    write_tiny_vlm(model_type, tmp_path / model_type, seed=4)
    write_processor(model_type, tmp_path / model_type)
    save_tokenizer(train_bpe_tokenizer(vocab_size=512, model_max_length=512), tmp_path / model_type)
    return tmp_path / model_type


@pytest.mark.parametrize("model_type, quant, kl_bound", [("llava", "int4", 1.0), ("llava", "fp8", 0.25),
                                                          ("qwen3_vl", "fp8", 0.25)])
def test_quantized_image_build_reports_image_prompts(tmp_path, model_type, quant, kl_bound):
    ckpt = _checkpoint(tmp_path, model_type)
    built = build(ckpt, tmp_path / "e", BuildOptions(quant=QuantRecipe(quant=quant)))
    report = built.report
    assert report["quantization"]["format"] == quant
    images, text = report["accuracy_images"], report["accuracy"]
    assert images["prompts"] == 4 and images["image_tokens"] > 0 and images["tokens"] > images["image_tokens"]
    for acc in (text, images):
        assert 0 < acc["kl_mean"] < kl_bound
        if quant == "fp8":
            assert acc["top1_agreement"] > 0.5
    # the engine takes images: its encoder graph is not quantized, its language model is
    section = built.manifest["multimodal"]
    assert section["encoder_graph"] == "vision_encoder" and not section["text_only"]
    engine = Engine.load(tmp_path / "e")
    out = engine.generate([[1, 7, IMAGE, 30, 41]], SamplingParams(max_tokens=6, ignore_eos=True),
                          images=[[random_image(np.random.default_rng())]])[0]
    assert len(out.token_ids) == 6 and engine.images.encoded == 1


def test_synthetic_images_are_fixed_by_their_seed_and_vary_in_size():
    a, b = synthetic_images(4), synthetic_images(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert len({x.shape for x in a}) > 1 and all(x.dtype == np.uint8 and x.shape[2] == 3 for x in a)
    assert not np.array_equal(synthetic_images(1, seed=1)[0], a[0])
