"""Idefics3 / SmolVLM images (issue 49 items 2-4): the SigLIP tower with an all-ones patch mask, the connector's pixel
shuffle and projection traced into the ``vision_encoder`` graph over any number of tiles (compiler/idefics3_vision.py),
each image cut into rows x cols tiles plus a global image and laid out as Idefics3Processor writes it
(``<fake_token_around_image><row_i_col_j>`` + image tokens per tile, a newline after each row, then
``<fake_token_around_image><global-img>`` + image tokens + ``<fake_token_around_image>``; the ids from the
checkpoint's tokenizer). The prompt tokens equal Idefics3Processor's; greedy tokens and log-probabilities equal
transformers' ``generate`` on its processor's pixels (fp32): 2x3 and 3x2 grids, an unsplit image, two images in one
prompt, an image in a second turn, batched and alone, with images split across prefill chunks; the prefix cache
hits on the same image and misses on another; a tokenizer without the layout's tokens is refused before any work."""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.runtime.tokenizer import Tokenizer
from llmc.testing.vlm import (
    IDEFICS3_TOKENS,
    VLM_PROCESSORS,
    assert_same_greedy,
    idefics3_processor,
    random_image,
    write_idefics3_tokenizer,
    write_processor,
    write_tiny_vlm,
)

torch = pytest.importorskip("torch")
FAKE, GLOBAL, IMAGE = 480, 481, 502  # the fixture tokenizer's ids (llmc.testing.vlm.write_idefics3_tokenizer)
NEW = 12
# (height, width) -> the tile grid at the fixture's 192-pixel longest edge and 64-pixel tiles
WIDE, TALL, SQUARE = (48, 80), (80, 48), (60, 60)  # 2x3, 3x2, 3x3


def _built(root, seed: int, **settings):
    hf = write_tiny_vlm("idefics3", root / "ckpt", seed=seed)
    image_processor = write_processor("idefics3", root / "ckpt")
    if settings:  # the same processor class with other settings (an unsplit image)
        image_processor = type(image_processor)(**{**VLM_PROCESSORS["idefics3"][1], **settings})
        image_processor.save_pretrained(root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, idefics3_processor(root / "ckpt", image_processor), built, root / "engine"


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return _built(tmp_path_factory.mktemp("idefics3"), seed=3)


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    """Every image's longest edge resized to one tile: no split, the global image alone."""
    return _built(tmp_path_factory.mktemp("idefics3_unsplit"), seed=4, size={"longest_edge": 64})


def _inputs(processor, text: str, images: list[bytes]):
    """Idefics3Processor's prompt ids, pixels and pixel mask of one sample."""
    from PIL import Image

    return processor(text=[text], images=[[Image.open(io.BytesIO(b)) for b in images]] if images else None,
                     return_tensors="pt")


def _reference(hf, processor, text: str, images: list[bytes]):
    """transformers' greedy tokens and their log-probabilities."""
    p = _inputs(processor, text, images)
    extra = {k: p[k] for k in ("pixel_values", "pixel_attention_mask") if k in p}
    with torch.no_grad():
        out = hf.generate(input_ids=p["input_ids"], **extra, max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, p["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_manifest_and_encoder_graph_over_any_tile_count(idefics3):
    hf, processor, built, engine_dir = idefics3
    section = built.manifest["multimodal"]
    tok = Tokenizer(engine_dir)
    assert section["layout"] == "tiles" and (section["fake_token_id"], section["global_token_id"]) == (FAKE, GLOBAL)
    assert section["tile_token_ids"] == [[tok.encode(f"<row_{i}_col_{j}>", add_special_tokens=False)[0]
                                          for j in (1, 2, 3)] for i in (1, 2, 3)]
    assert section["newline_ids"] == tok.encode("\n") and section["blank_line_ids"] == tok.encode("\n\n")
    encoder = load_graph(engine_dir, built.manifest, "vision_encoder")
    rng = np.random.default_rng()
    for size, frames in ((WIDE, 7), (TALL, 7), (SQUARE, 10)):
        p = _inputs(processor, "<image>", [random_image(rng, size)])
        assert p["pixel_values"].shape[1] == frames and bool(p["pixel_attention_mask"].all())
        with torch.no_grad():
            ref = hf.get_image_features(p["pixel_values"], p["pixel_attention_mask"]).pooler_output[0]
        (got,) = encoder.run({"pixel_values": p["pixel_values"][0].numpy()})
        assert got.shape == (frames, 4, 64)  # image_seq_len (64 / 16)² / 2² = 4 per tile
        np.testing.assert_allclose(got.reshape(-1, 64), ref.numpy(), atol=1e-5, rtol=1e-5)


def test_prompt_tokens_equal_idefics3_processor(idefics3):
    _, processor, _, engine_dir = idefics3
    rng = np.random.default_rng()
    images = [random_image(rng, WIDE), random_image(rng, TALL), random_image(rng, SQUARE)]
    text = "User: look<image> and\n<image>then<image>\nAssistant:"
    ids = Tokenizer(engine_dir).encode(text)
    expanded, spans, _ = Engine.load(engine_dir).images.expand(ids, images, "prompt")
    assert expanded == _inputs(processor, text, images)["input_ids"][0].tolist()
    # each image's features sit at its image tokens: 6 + 1, 6 + 1 and 9 + 1 frames of 4
    assert [len(s.slots) for s in spans] == [28, 28, 40]
    assert all((np.asarray(expanded)[s.start + s.slots] == IMAGE).all() for s in spans)


def test_images_match_transformers_batched_alone_and_chunked(idefics3):
    hf, processor, _, engine_dir = idefics3
    rng = np.random.default_rng()
    a, b, c = random_image(rng, WIDE), random_image(rng, TALL), random_image(rng, SQUARE)
    texts = ["User:<image>What is it?\nAssistant:", "User: two<image>and<image>compare\nAssistant:",
             "User: hello\nAssistant: hi there\nUser:<image>and this one?\nAssistant:", "User: no image\nAssistant:"]
    images = [[a], [b, c], [a], None]
    refs = [_reference(hf, processor, t, im or []) for t, im in zip(texts, images, strict=True)]
    tok = Tokenizer(engine_dir)
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir, max_num_tokens=10)  # images split across prefill chunks
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # a once, then from the engine's cache


def test_unsplit_images_match_transformers(unsplit):
    hf, processor, _, engine_dir = unsplit
    rng = np.random.default_rng()
    a, b = random_image(rng, WIDE), random_image(rng, SQUARE)
    texts = ["User:<image>What is it?\nAssistant:", "User:<image>or<image>?\nAssistant:"]
    images = [[a], [a, b]]
    assert _inputs(processor, texts[0], [a])["pixel_values"].shape[1] == 1  # the global image alone
    refs = [_reference(hf, processor, t, im) for t, im in zip(texts, images, strict=True)]
    tok = Tokenizer(engine_dir)
    engine = Engine.load(engine_dir, max_num_tokens=7)
    outs = engine.generate([tok.encode(t) for t in texts], SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                                         logprobs=0), images=images)
    for out, ref in zip(outs, refs, strict=True):
        _check(out, ref)


def test_prefix_cache_hits_the_same_image_and_misses_another(idefics3):
    _, _, _, engine_dir = idefics3
    rng = np.random.default_rng()
    a, b = random_image(rng, WIDE), random_image(rng, WIDE)
    prompt = Tokenizer(engine_dir).encode("User:<image>Describe it.\nAssistant:")  # 28 image tokens: 3 blocks of 16
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine.load(engine_dir)
    first = engine.generate([prompt], params, images=[[a]])[0]
    again = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 48 and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_a_tokenizer_without_the_layout_tokens_is_refused_before_any_work(tmp_path):
    write_tiny_vlm("idefics3", tmp_path / "ckpt", seed=1)
    write_processor("idefics3", tmp_path / "ckpt")
    write_idefics3_tokenizer(tmp_path / "ckpt", [t for t in IDEFICS3_TOKENS if t != "<row_3_col_2>"])
    with pytest.raises(UnsupportedError, match=r"tokenizer.json: .* 3x3 grid.* no single token <row_3_col_2>; .*"
                                               r"--text-only"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions())
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedError, match=r"tokenizer.json, which is missing.*--text-only"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions())
    assert not (tmp_path / "e").exists()
    built = build(tmp_path / "ckpt", tmp_path / "e", BuildOptions(text_only=True))
    assert built.manifest["multimodal"]["text_only"] is True
