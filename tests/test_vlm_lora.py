"""LoRA adapters on an image engine (issue 49 item 1: every recipe, LoRA included): ``--lora-slots`` with a vision
encoder. An adapter of the wrapper's language model (PEFT, saved from the wrapper itself) applies per request
beside images: greedy tokens and log-probabilities equal transformers' wrapper with the adapter merged, on its own
processor's pixels, in a batch with a request on the base model; on the CPU engine and on the CUDA engine's program
(run on the CPU). An adapter that also targets the vision encoder's layers is refused in one line naming the layer.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.testing.vlm import assert_same_greedy, greedy_with_logprobs, random_image, write_processor, write_tiny_vlm

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
IMAGE = 502
NEW = 8


def _adapter(checkpoint, out, targets, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    peft_model.save_pretrained(out)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-lora")
    hf = write_tiny_vlm("llava", root / "ckpt", seed=5)
    processor = write_processor("llava", root / "ckpt")
    merged = _adapter(root / "ckpt", root / "adapter", r".*language_model.*\.(q_proj|v_proj|down_proj)", seed=3)
    build(root / "ckpt", root / "cpu", BuildOptions(lora_slots=2))
    build(root / "ckpt", root / "cuda", BuildOptions(target="h100", dtype="float32", lora_slots=2,
                                                     aot_kernels=False))
    return hf, merged, processor, root


@pytest.mark.parametrize("engine", ["cpu", "cuda"])
def test_an_adapter_beside_images_equals_transformers_with_it_merged(llava, engine):
    from PIL import Image

    hf, merged, processor, root = llava
    rng = np.random.default_rng()
    img = random_image(rng, (int(rng.integers(30, 90)), int(rng.integers(30, 90))))
    pixels = processor([Image.open(io.BytesIO(img))], return_tensors="pt")["pixel_values"]
    prompt = [1, 7, IMAGE, 30, 41, 9]
    ids = [[t for x in prompt for t in ([IMAGE] * 16 if x == IMAGE else [x])]]
    want_lora = greedy_with_logprobs(merged, ids, NEW, pixel_values=pixels)
    want_base = greedy_with_logprobs(hf, ids, NEW, pixel_values=pixels)
    assert want_lora[0] != want_base[0]  # the adapter moves the output: the test can tell them apart
    eng = Engine.load(root / engine, **({"device": "cpu"} if engine == "cuda" else {}))
    eng.add_lora("lm", root / "adapter")
    with_lora = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0, lora="lm")
    base = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    got_lora, got_base = eng.generate([prompt, prompt], [with_lora, base], images=[[img], [img]])
    assert_same_greedy(got_lora, want_lora)
    assert_same_greedy(got_base, want_base)


def test_an_adapter_of_the_vision_encoder_is_refused_naming_the_layer(llava, tmp_path):
    _, _, _, root = llava
    _adapter(root / "ckpt", tmp_path / "all", ["q_proj", "v_proj"], seed=4)  # matches the vision tower's too
    eng = Engine.load(root / "cpu")
    with pytest.raises(UnsupportedError, match=r"targets model\.vision_tower\..*q_proj, outside the language model"):
        eng.add_lora("all", tmp_path / "all")
    assert eng.generate([[1, 7, 30]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids  # still serving
