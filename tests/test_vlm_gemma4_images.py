"""Gemma 4 images (issue 49 item 3): its vision tower, pooler and projector traced over the processor's padded
patch budget (compiler/gemma4_vision.py; the image's soft tokens are the pooled output's first rows), each image
laid out as Gemma4Processor writes it (``<boi>``, the soft tokens, ``<eoi>``; as many as the image's size gives), its
per-layer token embeddings from the ids with the image rows as padding, and the soft tokens attending to each other
both ways on the sliding layers only (``use_bidirectional_attention: "vision"``: ``attend_end`` reaches the sliding
layers' attention, the global layers stay causal). Greedy tokens and log-probabilities equal transformers' ``generate``
with its ``mm_token_type_ids`` (fp32): one image, two of different sizes, an image in a second turn, batched and
alone, with chunked prefill; a prefix-cache hit equals a miss."""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.testing.vlm import assert_same_greedy, greedy_with_logprobs, random_image, write_processor, write_tiny_vlm

torch = pytest.importorskip("torch")
BOI, EOI, IMAGE = 500, 501, 502
NEW = 12


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    hf = write_tiny_vlm("gemma4", root / "ckpt", seed=13)
    processor = write_processor("gemma4", root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, processor, built, root / "engine"


def _processed(processor, images: list[bytes]):
    from PIL import Image

    return processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")


def _reference(hf, processor, prompt: list[int], images: list[bytes]):
    """transformers' greedy tokens and log-probabilities, each image placeholder expanded as Gemma4Processor does."""
    extra, ids = {}, list(prompt)
    if images:
        p = _processed(processor, images)
        counts = iter(p["num_soft_tokens_per_image"].tolist())
        ids = [t for x in prompt for t in ([BOI, *[IMAGE] * next(counts), EOI] if x == IMAGE else [x])]
        extra = {"pixel_values": p["pixel_values"], "image_position_ids": p["image_position_ids"],
                 "mm_token_type_ids": (torch.tensor([ids]) == IMAGE).long()}
    return greedy_with_logprobs(hf, torch.tensor([ids]), NEW, **extra)


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_encoder_graph_equals_transformers_at_two_sizes(gemma4):
    hf, processor, built, engine_dir = gemma4
    section = built.manifest["multimodal"]
    assert section["layout"] == "wrap" and section["bidirectional"] == "sliding"
    assert (section["placeholder_token_id"], section["image_prefix"], section["image_suffix"]) == (IMAGE, [BOI],
                                                                                                   [EOI])
    encoder = load_graph(engine_dir, built.manifest, "vision_encoder")
    rng = np.random.default_rng()
    for size in ((40, 130), (200, 70)):
        p = _processed(processor, [random_image(rng, size)])
        with torch.no_grad():
            ref = hf.get_image_features(p["pixel_values"], p["image_position_ids"]).pooler_output[0]
        (got,) = encoder.run({"pixel_values": p["pixel_values"].numpy(),
                              "pixel_position_ids": p["image_position_ids"].numpy()})
        n = int(p["num_soft_tokens_per_image"][0])
        np.testing.assert_allclose(got[0, :n], ref.numpy(), atol=1e-5, rtol=1e-5)


def test_images_match_transformers_batched_alone_and_chunked(gemma4):
    hf, processor, _, engine_dir = gemma4
    rng = np.random.default_rng()
    a, b, c = random_image(rng, (64, 200)), random_image(rng, (150, 90)), random_image(rng, (70, 70))
    first = [1, 7, 30, 41, 9, 22]
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40],
               [*first, *_reference(hf, processor, first, [])[0][:6], 11, IMAGE, 19, 23], [1, 12, 99, 4]]
    images = [[a], [b, c], [a], None]
    refs = [_reference(hf, processor, p, im or []) for p, im in zip(prompts, images, strict=True)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir, max_num_tokens=64)
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    again = alone.generate([prompts[0]], params, images=[[a]])[0]
    assert again.num_cached_tokens > 0
    _check(again, refs[0])
