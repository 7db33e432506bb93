"""Mistral 3 images (issue 49 items 2-4): the Pixtral tower, patch merger and projector traced into the artifact's
``vision_encoder`` graph with symbolic height and width (compiler/pixtral_vision.py), each image resized to whole
merged patches and laid out as rows of ``[IMG]`` closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]``
(PixtralProcessor's tokens), its features at the ``[IMG]`` tokens only. Greedy tokens and log-probabilities equal
transformers' ``generate`` on its own processor's pixels (fp32): one image, two images of different sizes in one
prompt, an image after a first exchange, batched and alone, with images split across prefill chunks; the prefix
cache hits on the same image and misses on another."""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.testing.vlm import (
    PIXTRAL_TOKENS,
    assert_same_greedy,
    greedy_with_logprobs,
    random_image,
    write_processor,
    write_tiny_vlm,
)

torch = pytest.importorskip("torch")
IMAGE, BREAK, END = PIXTRAL_TOKENS["[IMG]"], PIXTRAL_TOKENS["[IMG_BREAK]"], PIXTRAL_TOKENS["[IMG_END]"]
NEW = 12
TOKEN_PIXELS = 32  # the tiny tower's 16-pixel patches, merged 2x2


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral3")
    hf = write_tiny_vlm("mistral3", root / "ckpt", seed=7)
    processor = write_processor("mistral3", root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, processor, built, root / "engine"


def _processed(processor, images: list[bytes]):
    """transformers' pixels and sizes, as Mistral 3's processor asks its image processor (whole merged patches)."""
    from PIL import Image

    out = processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt",
                    patch_size={"height": TOKEN_PIXELS, "width": TOKEN_PIXELS})
    return out["pixel_values"], out["image_sizes"]


def _expand(prompt: list[int], sizes) -> list[int]:
    """PixtralProcessor's expansion of each ``[IMG]`` placeholder into its image's rows."""
    ids, at = [], 0
    for t in prompt:
        if t != IMAGE:
            ids.append(t)
            continue
        h, w = (int(v) // TOKEN_PIXELS for v in sizes[at])
        rows = ([IMAGE] * w + [BREAK]) * h
        rows[-1] = END
        ids.extend(rows)
        at += 1
    return ids


def _reference(hf, processor, prompt: list[int], images: list[bytes]):
    """transformers' greedy tokens and their log-probabilities."""
    extra, ids = {}, list(prompt)
    if images:
        pixels, sizes = _processed(processor, images)
        extra, ids = {"pixel_values": pixels, "image_sizes": sizes}, _expand(prompt, sizes.tolist())
    return greedy_with_logprobs(hf, torch.tensor([ids]), NEW, **extra)


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_encoder_graph_takes_any_size_and_equals_transformers(mistral3):
    hf, processor, built, engine_dir = mistral3
    section = built.manifest["multimodal"]
    assert section["layout"] == "rows" and section["tokens_per_image"] is None
    assert (section["image_break_token_id"], section["image_end_token_id"], section["token_pixels"]) == \
        (BREAK, END, TOKEN_PIXELS)
    encoder = load_graph(engine_dir, built.manifest, "vision_encoder")
    rng = np.random.default_rng()
    for size in ((40, 130), (128, 33), (17, 40)):  # transformers squeezes a one-token image away: two or more
        pixels, sizes = _processed(processor, [random_image(rng, size)])
        with torch.no_grad():
            ref = hf.get_image_features(pixel_values=pixels, image_sizes=sizes,
                                        vision_feature_layer=hf.config.vision_feature_layer).pooler_output[0]
        (got,) = encoder.run({"pixel_values": pixels.numpy()})
        h, w = (int(v) // TOKEN_PIXELS for v in sizes[0])
        assert got.shape == (1, h * w, 64)
        np.testing.assert_allclose(got[0], ref.numpy(), atol=1e-5, rtol=1e-5)


def test_images_match_transformers_batched_alone_and_chunked(mistral3):
    hf, processor, _, engine_dir = mistral3
    rng = np.random.default_rng()
    a, b, c = (random_image(rng, (int(rng.integers(40, 130)), int(rng.integers(40, 130)))) for _ in range(3))
    first = [1, 7, 30, 41, 9, 22]
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40],
               # an image in the second turn: a first exchange's tokens, then the image and a question
               [*first, *_reference(hf, processor, first, [])[0][:6], 11, IMAGE, 19, 23], [1, 12, 99, 4]]
    images = [[a], [b, c], [a], None]
    refs = [_reference(hf, processor, p, im or []) for p, im in zip(prompts, images, strict=True)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir, max_num_tokens=10)  # images split across prefill chunks
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # a once, then from the engine's cache


def test_prefix_cache_hits_the_same_image_and_misses_another(mistral3):
    _, _, _, engine_dir = mistral3
    rng = np.random.default_rng()
    a, b = random_image(rng, (128, 128)), random_image(rng, (128, 128))
    prompt = [1, 7, IMAGE, *range(40, 60)]  # 22 + 4 x 5 image tokens = 42 tokens: two full blocks of 16
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine.load(engine_dir)
    first = engine.generate([prompt], params, images=[[a]])[0]
    again = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32 and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_a_checkpoint_without_its_layout_tokens_is_refused_before_any_work(tmp_path):
    write_tiny_vlm("mistral3", tmp_path / "ckpt", seed=1)
    with pytest.raises(UnsupportedError, match=r"tokenizer .* has no \[IMG_BREAK\], \[IMG_END\].*--text-only"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions())
    assert not (tmp_path / "e").exists()
