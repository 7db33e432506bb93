"""Images through a vision-language engine (issue 49 items 2 and 4), LLaVA first: the vision tower and projector
traced into the artifact's second graph (``vision_encoder``), the image processor stored beside it, the prompt's
placeholder expanded to the image's tokens and its features placed there. Greedy tokens and log-probabilities equal
transformers' ``generate`` on its own processor's pixels (fp32), for one image and for two in one prompt, batched and
alone, with an image split across prefill chunks; a different image with the same text misses the prefix cache."""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.testing.vlm import assert_same_greedy, random_image, write_processor, write_tiny_vlm

torch = pytest.importorskip("torch")
IMAGE = 502  # the tiny checkpoints' image token
NEW = 12


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    hf = write_tiny_vlm("llava", root / "ckpt", seed=5)
    processor = write_processor("llava", root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions())
    return hf, processor, built, root / "engine"


def _pixels(processor, images: list[bytes]):
    from PIL import Image

    return processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]


def _reference(hf, processor, prompt: list[int], images: list[bytes], tokens_per_image: int):
    """transformers' greedy tokens and their log-probabilities, the placeholder expanded as its processor does."""
    ids = [t for p in prompt for t in ([IMAGE] * tokens_per_image if p == IMAGE else [p])]
    with torch.no_grad():
        pixels = {"pixel_values": _pixels(processor, images)} if images else {}
        out = hf.generate(input_ids=torch.tensor([ids]), **pixels,
                          max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]


def _check(out, ref):
    assert_same_greedy(out, ref)


def test_encoder_graph_equals_transformers_image_features(llava):
    hf, processor, built, engine_dir = llava
    section = built.manifest["multimodal"]
    assert section["text_only"] is False and section["encoder_graph"] == "vision_encoder"
    assert section["image_token_id"] == IMAGE and section["tokens_per_image"] == 16
    assert built.manifest["engine"]["inputs"][-2:] == ["image_embeds", "image_rows"]
    assert "image_processor.json" in built.manifest["files"]
    pixels = _pixels(processor, [random_image(np.random.default_rng())])
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values=pixels, vision_feature_layer=hf.config.vision_feature_layer,
                                    vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
    (got,) = load_graph(engine_dir, built.manifest, "vision_encoder").run({"pixel_values": pixels.numpy()})
    np.testing.assert_allclose(got[0], ref.pooler_output[0].numpy(), atol=1e-5, rtol=1e-5)


def test_one_and_two_images_match_transformers_batched_and_alone(llava):
    hf, processor, built, engine_dir = llava
    per = built.manifest["multimodal"]["tokens_per_image"]
    rng = np.random.default_rng()
    a, b, c = (random_image(rng, (int(rng.integers(30, 90)), int(rng.integers(30, 90)))) for _ in range(3))
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40], [1, 12, 99, 4]]
    images = [[a], [b, c], None]
    refs = [_reference(hf, processor, p, im or [], per) for p, im in zip(prompts, images, strict=True)]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    # max_num_tokens 12: every image's 16 tokens are split across prefill chunks
    engine = Engine.load(engine_dir, max_num_tokens=12)
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        _check(out, ref)
    alone = Engine.load(engine_dir)
    for p, im, ref in zip(prompts, images, refs, strict=True):
        _check(alone.generate([p], params, images=[im])[0], ref)
    assert alone.images.encoded == 3  # each image encoded once, then served from the engine's cache


def test_a_different_image_misses_the_prefix_cache(llava):
    _, _, _, engine_dir = llava
    rng = np.random.default_rng()
    a, b = random_image(rng), random_image(rng)
    prompt = [1, 7, IMAGE, *range(40, 60)]  # 37 tokens: two full blocks of 16
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine.load(engine_dir)
    first = engine.generate([prompt], params, images=[[a]])[0]
    again = engine.generate([prompt], params, images=[[a]])[0]
    other = engine.generate([prompt], params, images=[[b]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32 and other.num_cached_tokens == 0
    assert again.token_ids == first.token_ids
    text = engine.generate([[t for t in prompt if t != IMAGE]], params)[0]
    assert text.num_cached_tokens == 0  # the same tokens without the image are other blocks


def test_bad_image_requests_are_refused(llava, tmp_path):
    _, _, _, engine_dir = llava
    engine = Engine.load(engine_dir)
    png = random_image(np.random.default_rng())
    with pytest.raises(LlmcError, match="2 images but 1 image placeholders"):
        engine.generate([[1, IMAGE, 5]], images=[[png, png]])
    with pytest.raises(LlmcError, match="not an image|cannot|image"):
        engine.generate([[1, IMAGE, 5]], images=[[b"not an image"]])
    assert not engine.has_unfinished()
    write_tiny_vlm("llava", tmp_path / "ckpt", seed=1)
    text_only = build(tmp_path / "ckpt", tmp_path / "text", BuildOptions(text_only=True))
    assert "image_embeds" not in text_only.manifest["engine"]["inputs"]
    with pytest.raises(LlmcError, match="takes no images"):
        Engine.load(tmp_path / "text").generate([[1, IMAGE, 5]], images=[[png]])


def test_what_image_builds_do_not_combine_with_yet_is_refused(tmp_path):
    write_tiny_vlm("llava", tmp_path / "ckpt", seed=1)
    with pytest.raises(UnsupportedError, match="--verify-passes is not combined with image inputs"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions(verify_passes=True))
    assert not (tmp_path / "e").exists()


def test_llama4_images_without_a_tokenizer_are_refused_and_text_only_still_builds(tmp_path):
    write_tiny_vlm("llama4", tmp_path / "ckpt", seed=1)  # its image layout's tokens come from the tokenizer
    with pytest.raises(UnsupportedError, match="tokenizer.json, which is missing.*--text-only"):
        build(tmp_path / "ckpt", tmp_path / "e", BuildOptions())
    assert not (tmp_path / "e").exists()
    built = build(tmp_path / "ckpt", tmp_path / "e", BuildOptions(text_only=True))
    assert built.manifest["multimodal"]["text_only"] is True


def test_inspect_shows_the_encoder(llava):
    from click.testing import CliRunner

    from llmc.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", str(llava[3])])
    assert shown.exit_code == 0, shown.output
    assert "LlavaForConditionalGeneration: images through graph 'vision_encoder'" in shown.output
    assert "graph     vision_encoder: onnxruntime vision_encoder.onnx, inputs pixel_values" in shown.output
