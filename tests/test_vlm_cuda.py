"""Images through the CUDA engine (issue 49, its ``--gpu`` item): ``llmc build --gpu h100`` of a vision-language
checkpoint writes the vision encoder as a program of its own beside the language model's (``vision_encoder/``: its
ops, weights in the engine dtype, and its LayerNorm / GELU kernels compiled ahead of time for sm_90a), and the CUDA
engine takes images as the CPU engine does.

No GPU here: the same programs run on torch's CPU ops (``Engine.load(device="cpu")``), their kernels under the Triton
interpreter. LLaVA's fp32 engine is held to transformers' ``generate`` on its own processor's pixels (greedy tokens
and log-probabilities within 1e-4); Gemma 3 (bidirectional image attention, a pooled projector) and Qwen3.5 (M-RoPE,
hybrid layers) to the CPU engine of the same checkpoint, which their own tests hold to transformers.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.graphs import load_graph
from llmc.testing.vlm import (
    assert_same_greedy,
    greedy_with_logprobs,
    random_image,
    write_processor,
    write_tiny_vlm,
)

torch = pytest.importorskip("torch")
IMAGE = 502  # the tiny checkpoints' image token
NEW = 10


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-cuda")
    hf = write_tiny_vlm("llava", root / "ckpt", seed=5)
    processor = write_processor("llava", root / "ckpt")
    built = build(root / "ckpt", root / "engine", BuildOptions(target="h100", dtype="float32"))
    return hf, processor, built, root / "engine"


def _pixels(processor, images: list[bytes]):
    from PIL import Image

    return processor([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")["pixel_values"]


def _features(hf, pixels):
    with torch.no_grad():
        return hf.get_image_features(pixel_values=pixels, vision_feature_layer=hf.config.vision_feature_layer,
                                     vision_feature_select_strategy=hf.config.vision_feature_select_strategy
                                     ).pooler_output[0]


def test_the_encoder_is_a_cuda_program_with_its_kernels_compiled_ahead_of_time(llava):
    _, _, built, engine_dir = llava
    entry = built.manifest["graphs"]["vision_encoder"]
    assert entry["backend"] == "cuda" and entry["dtype"] == "float32" and entry["inputs"] == ["pixel_values"]
    assert entry["fusions"] == {"encoder-attention": 1}  # the tiny tower's one layer, no [B, H, S, S] scores
    spec = json.loads((engine_dir / entry["program_file"]).read_text())
    ops = [n["op"] for n in spec["nodes"]]
    assert "EncoderAttention" in ops and "Softmax" not in ops and "Conv" in ops
    assert {k["op"] for k in entry["kernels"]} == {"layer_norm", "gelu"}
    named = {n["attrs"]["kernel"] for n in spec["nodes"] if "kernel" in n["attrs"]}
    assert named == {k["key"] for k in entry["kernels"]}  # every LayerNorm and GELU node runs its cubin
    for k in entry["kernels"]:
        cubin = (engine_dir / k["file"]).read_bytes()
        assert cubin[:4] == b"\x7fELF" and k["target"] == "sm_90a" and k["name"].encode() in cubin
    assert built.manifest["engine"]["backend"] == "cuda"
    assert built.manifest["engine"]["inputs"][-2:] == ["image_embeds", "image_rows"]
    from click.testing import CliRunner

    from llmc.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", str(engine_dir)])
    assert shown.exit_code == 0, shown.output
    assert ("graph     vision_encoder: cuda vision_encoder/program.json (float32, 2 AOT kernels), inputs pixel_values"
            in shown.output)


@pytest.mark.parametrize("interpret", [False, True], ids=["torch-ops", "aot-kernels-interpreted"])
def test_the_encoder_program_equals_transformers_image_features(llava, interpret):
    from llmc.runtime.workers.cuda.graph_program import CudaGraphProgram

    hf, processor, built, engine_dir = llava
    pixels = _pixels(processor, [random_image(np.random.default_rng())])
    entry = built.manifest["graphs"]["vision_encoder"]
    program = CudaGraphProgram(engine_dir, entry, "cpu", interpret_kernels=interpret)
    assert len(program.kernels) == (2 if interpret else 0)
    (got,) = program.run(entry["outputs"], {"pixel_values": pixels.numpy()})
    np.testing.assert_allclose(got[0], _features(hf, pixels).numpy(), atol=1e-5, rtol=1e-5)


def test_cuda_image_engine_matches_transformers_batched_alone_and_chunked(llava):
    hf, processor, _, engine_dir = llava
    rng = np.random.default_rng()
    a, b = (random_image(rng, (int(rng.integers(30, 90)), int(rng.integers(30, 90)))) for _ in range(2))
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40], [1, 12, 99, 4]]
    images = [[a], [b, a], None]
    refs = []
    for p, im in zip(prompts, images, strict=True):
        ids = [t for x in p for t in ([IMAGE] * 16 if x == IMAGE else [x])]
        refs.append(greedy_with_logprobs(hf, [ids], NEW, **({"pixel_values": _pixels(processor, im)} if im else {})))
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    engine = Engine.load(engine_dir, device="cpu", max_num_tokens=12)  # each image's 16 tokens over two steps
    for out, ref in zip(engine.generate(prompts, params, images=images), refs, strict=True):
        assert_same_greedy(out, ref)
    assert engine.images.encoded == 2
    alone = Engine.load(engine_dir, device="cpu")
    assert_same_greedy(alone.generate([prompts[1]], params, images=[images[1]])[0], refs[1])


def test_the_default_bf16_encoder_program_is_transformers_in_bf16(llava, tmp_path):
    hf, processor, _, engine_dir = llava
    built = build(engine_dir.parent / "ckpt", tmp_path / "bf16", BuildOptions(target="h100"))
    assert built.manifest["graphs"]["vision_encoder"]["dtype"] == "bfloat16"
    pixels = _pixels(processor, [random_image(np.random.default_rng())])
    (got,) = load_graph(tmp_path / "bf16", built.manifest, "vision_encoder", device="cpu").run(
        {"pixel_values": pixels.numpy()})
    want = _features(hf, pixels)
    scale = float(want.abs().max())
    # bf16 rounding (8 bits of mantissa) over a few ops: a few hundredths of the range, not a different feature
    assert float(np.abs(got[0] - want.numpy()).max()) < 0.03 * scale
    out = Engine.load(tmp_path / "bf16", device="cpu").generate(
        [[1, 7, IMAGE, 30]], SamplingParams(max_tokens=4, ignore_eos=True), images=[[random_image(
            np.random.default_rng())]])[0]
    assert len(out.token_ids) == 4


def _family(root, model_type: str):
    write_tiny_vlm(model_type, root / "ckpt", seed=5)
    write_processor(model_type, root / "ckpt")
    if model_type == "gemma3":  # its layout's blank lines come from the tokenizer
        from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

        save_tokenizer(train_bpe_tokenizer(vocab_size=512, model_max_length=512), root / "ckpt")
    cpu = build(root / "ckpt", root / "cpu", BuildOptions())
    # no cubins: the CPU runs the programs on torch ops (the kernels are compiled and checked above, on LLaVA)
    build(root / "ckpt", root / "cuda", BuildOptions(target="h100", dtype="float32", aot_kernels=False))
    return cpu.manifest


@pytest.mark.parametrize("model_type", ["gemma3", "qwen3_5"])
def test_cuda_image_engine_equals_the_cpu_engine(tmp_path, model_type):
    manifest = _family(tmp_path, model_type)
    placeholder = int(manifest["multimodal"].get("placeholder_token_id") or manifest["multimodal"]["image_token_id"])
    rng = np.random.default_rng()
    a, b = random_image(rng, (40, 70)), random_image(rng, (64, 48))
    prompts = [[1, 7, placeholder, 30, 41, 9], [1, 5, placeholder, 17, 33, placeholder, 40], [1, 12, 99, 4]]
    images = [[a], [a, b], None]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    want = Engine.load(tmp_path / "cpu").generate(prompts, params, images=images)
    got = Engine.load(tmp_path / "cuda", device="cpu", max_num_tokens=256).generate(prompts, params, images=images)
    for g, w in zip(got, want, strict=True):
        assert_same_greedy(g, (w.token_ids, [lp[t] for lp, t in zip(w.logprobs, w.token_ids, strict=True)]))


def test_a_tensor_parallel_image_engine_equals_one_rank(llava, tmp_path):
    """--tp 2 (two ranks on the CPU over gloo): the encoder runs once on rank 0, its rows reach every rank with the
    step's inputs; tokens and log-probabilities as the one-rank engine's."""
    _, _, _, engine_dir = llava
    built = build(engine_dir.parent / "ckpt", tmp_path / "tp2",
                  BuildOptions(target="h100", dtype="float32", tp=2, aot_kernels=False))
    assert built.manifest["parallel"]["tensor"] == 2 and "vision_encoder" in built.manifest["graphs"]
    rng = np.random.default_rng()
    a, b = random_image(rng, (40, 70)), random_image(rng, (64, 48))
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40]]
    images = [[a], [a, b]]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0)
    want = Engine.load(engine_dir, device="cpu").generate(prompts, params, images=images)
    got = Engine.load(tmp_path / "tp2", device="cpu", max_num_tokens=12).generate(prompts, params, images=images)
    for g, w in zip(got, want, strict=True):
        assert_same_greedy(g, (w.token_ids, [lp[t] for lp, t in zip(w.logprobs, w.token_ids, strict=True)]))
