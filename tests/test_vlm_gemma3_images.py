"""Gemma 3 images (issue 49 item 3): SigLIP and the pooling projector traced into the ``vision_encoder`` graph, each
image laid out as Gemma3Processor writes it (a blank line, ``<start_of_image>``, the soft tokens, ``<end_of_image>``,
a blank line: the blank line's ids from the checkpoint's tokenizer), and the image's soft tokens attending to each
other both ways (transformers' ``token_type_ids`` blocks; llmc's ``attend_end`` input of every attention, on sliding
and global layers). Greedy tokens and log-probabilities equal transformers' ``generate`` with its
``token_type_ids`` (fp32): one image, two images, an image after a first exchange, batched and alone, with chunked
prefill that never ends inside an image; from the prefix cache = without it; another image misses it."""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import LlmcError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.core.scheduler import fit_chunk
from llmc.runtime.tokenizer import Tokenizer
from llmc.testing.vlm import assert_same_greedy, greedy_with_logprobs, random_image, write_processor, write_tiny_vlm

torch = pytest.importorskip("torch")
BOI, EOI, SOFT = 500, 501, 502  # the tiny config's start/end-of-image and soft image tokens
NEW = 12


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    root = tmp_path_factory.mktemp("gemma3")
    hf = write_tiny_vlm("gemma3", root / "ckpt", seed=11)
    processor = write_processor("gemma3", root / "ckpt")
    save_tokenizer(train_bpe_tokenizer(vocab_size=512, model_max_length=512), root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    blank = Tokenizer(root / "ckpt").encode("\n\n", add_special_tokens=False)
    return hf, processor, built, root / "engine", blank


def _reference(hf, processor, prompt: list[int], images: list[bytes], blank: list[int]):
    """transformers' greedy tokens and log-probabilities, each ``<start_of_image>`` expanded as Gemma3Processor
    does, with its token_type_ids (1 at the soft tokens)."""
    from PIL import Image

    per = hf.config.mm_tokens_per_image
    ids = [t for p in prompt for t in ([*blank, BOI, *[SOFT] * per, EOI, *blank] if p == BOI else [p])]
    extra = {}
    if images:
        pixels = processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]
        extra = {"pixel_values": pixels, "token_type_ids": (torch.tensor([ids]) == SOFT).long()}
    return greedy_with_logprobs(hf, torch.tensor([ids]), NEW, **extra)


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_manifest_and_the_bidirectional_input(gemma3):
    _, _, built, _, blank = gemma3
    section = built.manifest["multimodal"]
    assert section["layout"] == "wrap" and section["bidirectional"] == "all"
    assert section["placeholder_token_id"] == BOI and section["image_token_id"] == SOFT
    assert section["image_prefix"] == [*blank, BOI] and section["image_suffix"] == [EOI, *blank]
    assert built.manifest["engine"]["inputs"][-1] == "attend_end"


def test_images_match_transformers_batched_alone_and_chunked(gemma3):
    hf, processor, _, engine_dir, blank = gemma3
    rng = np.random.default_rng()
    a, b, c = (random_image(rng, (int(rng.integers(30, 90)), int(rng.integers(30, 90)))) for _ in range(3))
    first = [1, 7, 30, 41, 9, 22]
    prompts = [[1, 7, BOI, 30, 41, 9], [1, 5, BOI, 17, 33, BOI, 40],
               [*first, *_reference(hf, processor, first, [], blank)[0][:6], 11, BOI, 19, 23], [1, 12, 99, 4]]
    images = [[a], [b, c], [a], None]
    refs = [_reference(hf, processor, p, im or [], blank) for p, im in zip(prompts, images, strict=True)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    # 7-token steps: chunks end before an image's 4 soft tokens or after them, never inside
    engine = Engine.load(engine_dir, max_num_tokens=7)
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # a once, then from the engine's cache


def test_a_prefix_cache_hit_inside_an_image(gemma3):
    """27 text tokens, then the image: its soft tokens at 30-33 (after a 2-token blank line and BOI here), so the
    cached 32 tokens end inside them; the rest of the image runs in one step, as transformers' block mask wants."""
    hf, processor, _, engine_dir, blank = gemma3
    assert len(blank) == 2
    rng = np.random.default_rng()
    a, b = random_image(rng), random_image(rng)
    prompt = [1, *range(40, 66), BOI, 70, 71, 72]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    ref = _reference(hf, processor, prompt, [a], blank)
    engine = Engine.load(engine_dir, max_num_tokens=16)
    first = engine.generate([prompt], params, images=[[a]])[0]
    hit = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    assert (first.num_cached_tokens, hit.num_cached_tokens, other.num_cached_tokens) == (0, 32, 0)
    _check(first, ref)
    _check(hit, ref)


def test_an_image_larger_than_a_step_is_refused(gemma3):
    _, _, _, engine_dir, _ = gemma3
    engine = Engine.load(engine_dir, max_num_tokens=3)
    with pytest.raises(LlmcError, match="4 tokens attends to all of its tokens in one step.*max_num_tokens=3"):
        engine.generate([[1, BOI, 5]], images=[[random_image(np.random.default_rng())]])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("start, n, budget, fitted", [
    (0, 7, 7, 7),     # ends before the span
    (0, 12, 12, 10),  # would end inside [10, 14): cut back to 10
    (10, 2, 8, 4),    # starts at the span, would end inside: run to its end
    (12, 1, 8, 2),    # starts inside (a prefix-cache hit): to its end
    (12, 1, 1, 0),    # ... which the budget does not allow: not this step
    (0, 14, 14, 14),  # ends exactly at the span's end
])
def test_fit_chunk(start, n, budget, fitted):
    assert fit_chunk([(10, 14), (30, 34)], start, n, budget) == fitted
