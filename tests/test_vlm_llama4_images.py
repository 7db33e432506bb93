"""Llama 4 images (issue 49 items 2-4): its own ``get_image_features`` (unfold patch embedding, class token, 2-D
rotary, pixel-shuffle MLP, projector) traced into the ``vision_encoder`` graph over any number of tiles
(compiler/llama4_vision.py); each image fitted into a canvas of whole tiles plus a global tile by llmc's numpy
processor (runtime/vision/processors/llama4.py: transformers' Llama4ImageProcessor needs torchvision, which cannot
be installed here, so the model path is checked on llmc's pixels, and its canvas choice against transformers' own
functions run from their source) and laid out as Llama4Processor's ``_prompt_split_image`` writes it, beside the text
model's chunked attention (chunk 16 here: images span chunks). Greedy tokens and log-probabilities equal
transformers' ``generate`` (fp32): one tile, 1x2, 3x1 and 2x2 canvases, two images in one prompt, an image in a
second turn, batched and alone, with images split across prefill chunks; the prefix cache hits on the same image
and misses on another; a tokenizer without the layout's tokens is refused before any work."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.vision.processors import llama4 as llama4_processor
from llmc.testing.vlm import (
    LLAMA4_TOKENS,
    assert_same_greedy,
    greedy_with_logprobs,
    random_image,
    write_llama4_processor,
    write_tiny_vlm,
)

torch = pytest.importorskip("torch")
PATCH = 502  # the tiny config's image token: Llama4Processor's <|patch|>
NEW = 12
# (height, width) -> the canvas at 64-pixel tiles, up to 4 of them
ONE, WIDE, TALL, SQUARE = (50, 60), (48, 80), (200, 70), (130, 130)  # 1x1, 1x2, 3x1, 2x2


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llama4")
    hf = write_tiny_vlm("llama4", root / "ckpt", seed=5)
    processor = write_llama4_processor(root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, processor, AutoTokenizer.from_pretrained(root / "ckpt"), built, root / "engine"


def _pixels(processor, images: list[bytes]):
    features = processor(images)
    return torch.from_numpy(features.pixel_values), features.extras["aspect_ratios"].tolist()


def _prompt_ids(tokenizer, text: str, ratios) -> list[int]:
    """Llama4Processor's expansion of each ``<|image|>`` (its own ``_prompt_split_image``), then its tokenizer."""
    from transformers import Llama4Processor

    per = 4  # (64 / 16)² patches per tile, pixel-shuffled by 0.5 each side
    parts = text.split("<|image|>")
    assert len(parts) == len(ratios) + 1
    out = parts[0]
    for ratio, part in zip(ratios, parts[1:], strict=True):
        out += Llama4Processor._prompt_split_image(None, ratio, per) + part
    return tokenizer(out, add_special_tokens=False)["input_ids"]


def _reference(hf, processor, tokenizer, text: str, images: list[bytes]):
    """transformers' greedy tokens and their log-probabilities on llmc's pixels."""
    extra, ratios = {}, []
    if images:
        pixels, ratios = _pixels(processor, images)
        extra = {"pixel_values": pixels}
    ids = _prompt_ids(tokenizer, text, ratios)
    return greedy_with_logprobs(hf, torch.tensor([ids]), NEW, **extra)


def _check(out, ref):
    assert_same_greedy(out, ref)


def _transformers_fit():
    """transformers' find_supported_resolutions and get_best_fit, run from their source (their module imports
    torchvision, which is not installed here; these two functions use torch only)."""
    import collections
    import functools
    import math

    import transformers

    path = Path(transformers.__file__).parent / "models" / "llama4" / "image_processing_llama4.py"
    tree = ast.parse(path.read_text())
    wanted = {"get_factors", "find_supported_resolutions", "get_best_fit", "get_max_res_without_distortion"}
    module = ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], [])
    space = {"torch": torch, "math": math, "defaultdict": collections.defaultdict, "lru_cache": functools.lru_cache,
             "SizeDict": object}
    exec(compile(module, str(path), "exec"), space)  # noqa: S102 - transformers' own source, read from disk
    return space


def test_canvas_choice_equals_transformers_functions():
    from transformers.image_utils import SizeDict

    ref = _transformers_fit()
    rng = np.random.default_rng(0)
    for max_patches in (4, 16):
        resolutions = llama4_processor.supported_resolutions(max_patches, 336)
        ref_res = ref["find_supported_resolutions"](max_patches, SizeDict(height=336, width=336))
        assert resolutions == [tuple(r) for r in ref_res]
        for _ in range(300):
            h, w = (int(v) for v in rng.integers(8, 3000, 2))
            for to_max in (False, True):
                want = ref["get_best_fit"]((h, w), torch.tensor(ref_res), resize_to_max_canvas=to_max).tolist()
                assert list(llama4_processor.best_fit(h, w, resolutions, to_max)) == want, (h, w, to_max)
            assert llama4_processor.max_res_without_distortion(h, w, 672, 1008) == \
                ref["get_max_res_without_distortion"]((h, w), (672, 1008))


def test_manifest_and_encoder_graph_over_any_tile_count(llama4):
    hf, processor, tokenizer, built, engine_dir = llama4
    section = built.manifest["multimodal"]
    ids = {n: tokenizer.convert_tokens_to_ids(n) for n in LLAMA4_TOKENS}
    assert section["layout"] == "separators" and section["image_token_id"] == PATCH
    assert section["placeholder_token_id"] == section["image_marker_id"] == ids["<|image|>"]
    assert (section["image_start_id"], section["image_end_id"], section["tile_x_separator_id"],
            section["tile_y_separator_id"]) == (ids["<|image_start|>"], ids["<|image_end|>"],
                                                ids["<|tile_x_separator|>"], ids["<|tile_y_separator|>"])
    encoder = load_graph(engine_dir, built.manifest, "vision_encoder")
    rng = np.random.default_rng()
    for size, tiles in ((ONE, 1), (WIDE, 3), (TALL, 4), (SQUARE, 5)):
        pixels, _ = _pixels(processor, [random_image(rng, size)])
        assert pixels.shape == (tiles, 3, 64, 64)
        with torch.no_grad():
            ref = hf.get_image_features(pixel_values=pixels).pooler_output
        (got,) = encoder.run({"pixel_values": pixels.numpy()})
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-5, rtol=1e-5)


def test_prompt_tokens_equal_llama4_processor_layout(llama4):
    _, processor, tokenizer, _, engine_dir = llama4
    rng = np.random.default_rng()
    images = [random_image(rng, s) for s in (ONE, WIDE, TALL, SQUARE)]
    text = "look<|image|> and\n<|image|>then<|image|><|image|>?"
    expanded, spans, _ = Engine.load(engine_dir).images.expand(Tokenizer(engine_dir).encode(text), images, "prompt")
    assert expanded == _prompt_ids(tokenizer, text, _pixels(processor, images)[1])
    assert [len(s.slots) for s in spans] == [4, 12, 16, 20]  # (tiles + global) x 4 patches
    assert all((np.asarray(expanded)[s.start + s.slots] == PATCH).all() for s in spans)


def test_images_match_transformers_batched_alone_and_chunked(llama4):
    hf, processor, tokenizer, _, engine_dir = llama4
    rng = np.random.default_rng()
    a, b, c = random_image(rng, WIDE), random_image(rng, TALL), random_image(rng, SQUARE)
    texts = ["user: <|image|>What is it? assistant:", "user: two<|image|>and<|image|>compare assistant:",
             "user: hello assistant: hi there user: <|image|>and this one? assistant:", "user: no image assistant:"]
    images = [[a], [b, c], [c], None]
    refs = [_reference(hf, processor, tokenizer, t, im or []) for t, im in zip(texts, images, strict=True)]
    tok = Tokenizer(engine_dir)
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir, max_num_tokens=10)  # images split across prefill chunks
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # c once, then from the engine's cache
    one = random_image(rng, ONE)  # a single tile: no separators, no global tile
    _check(alone.generate([tok.encode(texts[0])], params, images=[[one]])[0],
           _reference(hf, processor, tokenizer, texts[0], [one]))


def test_prefix_cache_hits_the_same_image_and_misses_another(llama4):
    _, _, _, _, engine_dir = llama4
    rng = np.random.default_rng()
    a, b = random_image(rng, SQUARE), random_image(rng, SQUARE)
    prompt = Tokenizer(engine_dir).encode("user: <|image|>Describe it. assistant:")  # 20 patches, 27 image tokens
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine.load(engine_dir)
    first = engine.generate([prompt], params, images=[[a]])[0]
    again = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16 and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_a_tokenizer_without_the_layout_tokens_is_refused_before_any_work(tmp_path):
    write_tiny_vlm("llama4", tmp_path / "ckpt", seed=1)
    write_llama4_processor(tmp_path / "ckpt", [t for t in LLAMA4_TOKENS if t != "<|tile_y_separator|>"])
    with pytest.raises(UnsupportedError, match=r"tokenizer.json: .* no single token <\|tile_y_separator\|>; .*"
                                               r"--text-only"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions())
    assert not (tmp_path / "e").exists()
    built = build(tmp_path / "ckpt", tmp_path / "e", BuildOptions(text_only=True))
    assert built.manifest["multimodal"]["text_only"] is True
