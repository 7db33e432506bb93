"""Images through Qwen3.5 and Qwen3-VL engines (issue 49 items 2-4).

The vision encoder (patch embedding, blocks with their 2-D rotary, merger) is traced once for any number of
patches, its grid-derived inputs computed in numpy; the placeholder expands to grid_h * grid_w / merge² tokens;
the language model is fed transformers' 3-D M-RoPE positions, decoded tokens continuing from the image's largest
position; Qwen3-VL's deepstack features are added to its first layers' hidden states at the image rows. Greedy
tokens and log-probabilities equal transformers' ``generate`` on its own processor's outputs (fp32): one image, two
images of two sizes in one prompt, text only, batched and alone, with images split across prefill chunks (Qwen3.5:
the Gated DeltaNet state carried between them)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.artifact import read_manifest
from llmc.runtime.graphs import load_graph
from llmc.runtime.mrope import positions_of, prompt_positions
from llmc.runtime.vision.qwen_grid import encoder_inputs
from llmc.testing.vlm import assert_same_greedy, greedy_with_logprobs, random_image, write_processor, write_tiny_vlm

torch = pytest.importorskip("torch")
START, END, IMAGE = 500, 501, 502  # the tiny checkpoints' vision start / end and image tokens
NEW = 12
SIZES = [(96, 128), (160, 96), (64, 224)]  # (height, width) pixels: 12, 15 and 14 image tokens


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_vl"])
def qwen(request, tmp_path_factory, vlm_checked_image_build):
    root = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_vlm(request.param, root / "ckpt", seed=5)
    processor = write_processor(request.param, root / "ckpt")
    if request.param == "qwen3_5":
        # The session's build of this same checkpoint (tests/conftest.py; tests/test_vlm_text.py reads its
        # self-check): the same default options, so the same engine.
        from tests.conftest import same_checkpoint

        shared = vlm_checked_image_build(request.param)
        assert same_checkpoint(root / "ckpt", shared / "ckpt")
        engine = shared / "engine"
        return hf, processor, SimpleNamespace(manifest=read_manifest(engine)), engine
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, processor, built, root / "engine"


def _processed(processor, images: list[bytes]):
    from PIL import Image

    return processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")


def _reference(hf, processor, prompt: list[int], images: list[bytes]):
    """transformers' greedy tokens and their log-probabilities, each placeholder expanded to its image's tokens as
    its processor does, with the mm_token_type_ids its processor returns."""
    extra, ids = {}, list(prompt)
    if images:
        extra = dict(_processed(processor, images))
        counts = iter((extra["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for p in prompt for t in ([IMAGE] * next(counts) if p == IMAGE else [p])]
        extra["mm_token_type_ids"] = (torch.tensor([ids]) == IMAGE).int()
    return greedy_with_logprobs(hf, torch.tensor([ids]), NEW, **extra)


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_encoder_graph_equals_transformers_image_features_at_any_size(qwen):
    hf, processor, built, engine_dir = qwen
    section = built.manifest["multimodal"]
    assert section["positions"] == "mrope" and section["tokens_per_image"] is None
    assert built.manifest["engine"]["inputs"][-3:] == ["image_embeds", "image_rows", "mrope_positions"]
    encoder = load_graph(engine_dir, built.manifest, "vision_encoder")
    rng = np.random.default_rng()
    for size in SIZES:
        out = _processed(processor, [random_image(rng, size)])
        with torch.no_grad():
            features = hf.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
        # Qwen3-VL: each token's deepstack features beside its own
        ref = torch.cat([features.pooler_output[0], *(d[0] for d in getattr(features, "deepstack_features", None)
                                                      or ())], dim=-1)
        grid = tuple(out["image_grid_thw"][0].tolist())
        feeds = {"pixel_values": out["pixel_values"].numpy(),
                 **encoder_inputs(grid, section["merge_size"], section["position_table_side"])}
        (got,) = encoder.run(feeds)
        assert got.shape == (1, grid[1] * grid[2] // 4, 64 * (1 + section["deepstack_layers"]))
        np.testing.assert_allclose(got[0], ref.numpy(), atol=1e-5, rtol=1e-5)


def test_mrope_positions_equal_transformers_get_rope_index(qwen):
    hf = qwen[0]
    ids = [1, 7, START, *[IMAGE] * 12, END, 9, START, *[IMAGE] * 15, END, 4, 4]
    grids = torch.tensor([[1, 6, 8], [1, 10, 6]])
    ref, delta = hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == IMAGE).int(), grids)
    table, got_delta = prompt_positions(len(ids), [(3, 3, 4), (18, 5, 3)])
    np.testing.assert_array_equal(table, ref[:, 0].numpy())
    assert got_delta == int(delta)
    np.testing.assert_array_equal(positions_of(table, got_delta, len(ids) - 1, 3)[:, 1:],
                                  np.broadcast_to(np.arange(len(ids), len(ids) + 2) + got_delta, (3, 2)))


def test_one_and_two_images_of_two_sizes_match_transformers_batched_and_alone(qwen):
    hf, processor, _, engine_dir = qwen
    rng = np.random.default_rng()
    a, b, c = (random_image(rng, size) for size in SIZES)
    prompts = [[1, 7, START, IMAGE, END, 30, 41, 9], [1, 5, START, IMAGE, END, 17, START, IMAGE, END, 40],
               [1, 12, 99, 4]]
    images = [[a], [b, c], None]
    refs = [_reference(hf, processor, p, im or []) for p, im in zip(prompts, images, strict=True)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    # max_num_tokens 8: every image's tokens are split across prefill chunks, the recurrent state carried over
    engine = Engine.load(engine_dir, max_num_tokens=8)
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # each image encoded once, then served from the engine's cache


def test_the_rotary_reads_the_3d_positions_never_the_token_index(qwen):
    """Fusions must not fold the M-RoPE as a 1-D rotary: no rotary node of the engine takes position ids, and its
    logits follow ``mrope_positions`` alone: another token index changes nothing, other 3-D positions change them."""
    import onnx

    engine_dir = qwen[3]
    model = onnx.load(engine_dir / "model.onnx", load_external_data=False)
    assert not [n.name for n in model.graph.node if "Rotary" in n.op_type and len(n.input) > 3 and n.input[3]]
    engine = Engine.load(engine_dir)
    ids = [1, 7, 30, 41, 9, 17, 33, 40, 12, 99]
    base = engine.score(ids)
    run = engine._session.run

    def with_feeds(change):
        def patched(feeds, *args, **kwargs):
            return run({**feeds, **change(feeds)}, *args, **kwargs)
        engine._session.run = patched
        try:
            return engine.score(ids)
        finally:
            engine._session.run = run

    np.testing.assert_array_equal(with_feeds(lambda f: {"positions": f["positions"][::-1] * 3}), base)
    moved = with_feeds(lambda f: {"mrope_positions": f["mrope_positions"] * [[1], [2], [3]]})
    assert np.abs(moved - base).max() > 1e-3


def test_the_prefix_cache_keys_qwen_images_by_content_and_a_later_turn_matches(qwen):
    """The same image and text hit the prefix cache with the same tokens (Qwen3-VL; Qwen3.5's hybrid engine has no
    prefix cache); a different image of the same size and the same text misses it. An image in a later turn (after
    a first turn's text and answer) still equals transformers: its M-RoPE positions continue after the text."""
    hf, processor, _, engine_dir = qwen
    rng = np.random.default_rng()
    a, b = random_image(rng, SIZES[0]), random_image(rng, SIZES[0])
    prompt = [1, 7, START, IMAGE, END, *range(40, 60)]  # 12 image tokens: 35 tokens, two full blocks of 16
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir)
    first = engine.generate([prompt], params, images=[[a]])[0]
    again = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    # Qwen3.5's Gated DeltaNet layers keep state a cached block cannot restore: its engines run without prefix caching
    hit = 0 if engine.prefix_caching_disabled_reason else 32
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == hit and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    _check(again, _reference(hf, processor, prompt, [a]))
    later = [1, 7, 30, 41, 9, 2, 17, 33, 40, 2, 1, 12, START, IMAGE, END, 99, 4]  # turn 1, its answer, then turn 2
    _check(engine.generate([later], params, images=[[b]])[0], _reference(hf, processor, later, [b]))
