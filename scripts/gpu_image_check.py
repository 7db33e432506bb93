"""The ``images`` section of ``scripts/gpu_check.py``: image engines on the GPU (issue 49's ``--gpu`` item).

- llava fp32: a tiny random LLaVA (llmc.testing.vlm) built with ``llmc build --gpu auto --dtype float32``: its vision
  encoder's program and AOT kernels (LayerNorm, GELU) loaded on the GPU; greedy tokens and log-probabilities of one
  image, two images and no image against transformers on the same GPU (fp32, TF32 off); decode steps after an image
  replayed from CUDA graphs; the encoder's features against transformers'.
- llava bf16 (the default dtype): the encoder's features against transformers' in bf16 (relative to their range).
- encoder speed: a Gemma-3-4B-shaped SigLIP (27 layers, width 1152, 896x896 -> 4096 patches; random weights, one text
  layer) built for the GPU in bf16: the encoder program's time per image beside transformers' own vision tower +
  projector (``get_image_features``, sdpa attention), same weights, same device.

Not run under ``--cpu-smoke``: tests/test_vlm_cuda.py runs the same programs on the CPU.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

IMAGE = 502


def _build(ckpt: Path, out: Path, cache: Path, *flags: str, gpu: str = "auto") -> float:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(ckpt), "--gpu", gpu, "-o", str(out),
                           "-q", "--cache-dir", str(cache), *flags], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"build rc {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return round(time.time() - t0, 1)


def _llava(work: Path, device: str = "cuda") -> dict:
    import numpy as np
    import torch
    from PIL import Image

    from llmc.runtime import Engine, SamplingParams
    from llmc.runtime.graphs import load_graph
    from llmc.testing.vlm import greedy_with_logprobs, random_image, write_processor, write_tiny_vlm

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    row: dict = {"ok": False}
    hf = write_tiny_vlm("llava", work / "llava" / "ckpt", seed=5)
    processor = write_processor("llava", work / "llava" / "ckpt")
    gpu = "auto" if device == "cuda" else "h100"  # a dry run on the CPU: the H100's programs
    row["build_s"] = _build(work / "llava" / "ckpt", work / "llava" / "fp32", work / "cache", "--dtype", "float32",
                            gpu=gpu)
    hf = hf.to(device).eval()
    rng = np.random.default_rng(0)
    a, b = random_image(rng, (40, 70)), random_image(rng, (64, 48))
    prompts = [[1, 7, IMAGE, 30, 41, 9], [1, 5, IMAGE, 17, 33, IMAGE, 40], [1, 12, 99, 4]]
    images = [[a], [b, a], None]

    def pixels(im):
        return processor([Image.open(io.BytesIO(x)) for x in im], return_tensors="pt")["pixel_values"].to(device)

    refs = []
    for p, im in zip(prompts, images, strict=True):
        ids = [[t for x in p for t in ([IMAGE] * 16 if x == IMAGE else [x])]]
        refs.append(greedy_with_logprobs(hf, torch.tensor(ids, device=device), 16,
                                         **({"pixel_values": pixels(im)} if im else {})))
    eng = Engine.load(work / "llava" / "fp32", kv_cache_tokens=4096, verify=False, device=device)
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0), images=images)
    row["tokens_equal"] = [o.token_ids == r[0] for o, r in zip(outs, refs, strict=True)]
    row["max_logprob_diff"] = max(abs(lp[t] - w) for o, r in zip(outs, refs, strict=True)
                                  for lp, t, w in zip(o.logprobs, o.token_ids, r[1], strict=False))
    session = eng._stepper.session
    row["graph_replays"], row["eager_steps"] = session.graph_replays, session.eager_steps
    row["encoder_kernels"] = len(eng.images._encoder.session.kernels)
    px = pixels([a])
    with torch.no_grad():
        want = hf.get_image_features(pixel_values=px, vision_feature_layer=hf.config.vision_feature_layer,
                                     vision_feature_select_strategy=hf.config.vision_feature_select_strategy
                                     ).pooler_output[0].float().cpu().numpy()
    manifest = eng.manifest
    feeds = {"pixel_values": px.cpu().numpy()}
    (got,) = load_graph(work / "llava" / "fp32", manifest, "vision_encoder", device=device).run(feeds)
    row["encoder_max_abs_diff"] = float(np.abs(got[0] - want).max())
    # the default dtype: bf16 features against transformers' bf16 model, relative to the features' range
    row["bf16_build_s"] = _build(work / "llava" / "ckpt", work / "llava" / "bf16", work / "cache", gpu=gpu)
    from llmc.runtime.artifact import read_manifest

    manifest16 = read_manifest(work / "llava" / "bf16")
    (got16,) = load_graph(work / "llava" / "bf16", manifest16, "vision_encoder", device=device).run(feeds)
    hf16 = hf.to(torch.bfloat16)
    with torch.no_grad():
        want16 = hf16.get_image_features(pixel_values=px.to(torch.bfloat16),
                                         vision_feature_layer=hf.config.vision_feature_layer,
                                         vision_feature_select_strategy=hf.config.vision_feature_select_strategy
                                         ).pooler_output[0].float().cpu().numpy()
    row["bf16_encoder_rel_diff"] = float(np.abs(got16[0] - want16).max() / max(1e-6, float(np.abs(want16).max())))
    on_gpu = device == "cuda"
    row["ok"] = (all(row["tokens_equal"]) and row["max_logprob_diff"] < 1e-3
                 and (row["graph_replays"] > 0 and row["encoder_kernels"] == 2 or not on_gpu)
                 and row["encoder_max_abs_diff"] < 1e-4
                 and row["bf16_encoder_rel_diff"] < 0.05)
    return row


def _speed(work: Path, time_cuda, device: str = "cuda", layers: int = 27) -> dict:
    """Gemma 3 4B's SigLIP shape, random weights: the encoder program vs transformers' tower on one 896x896 image."""
    import numpy as np
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from llmc.runtime.graphs import load_graph
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer
    ckpt = work / "gemma3-4b-vision" / "ckpt"
    cfg = Gemma3Config(
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, vocab_size=512, sliding_window=512),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers, num_attention_heads=16,
                           image_size=896, patch_size=14),
        mm_tokens_per_image=256, boi_token_index=500, eoi_token_index=501, image_token_index=502)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(ckpt)
    import transformers

    transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}).save_pretrained(ckpt)
    save_tokenizer(train_bpe_tokenizer(vocab_size=512, model_max_length=512), ckpt)
    row: dict = {"layers": layers, "build_s": _build(ckpt, work / "gemma3-4b-vision" / "engine", work / "cache",
                                                     gpu="auto" if device == "cuda" else "h100")}
    from llmc.runtime.artifact import read_manifest

    manifest = read_manifest(work / "gemma3-4b-vision" / "engine")
    graph = load_graph(work / "gemma3-4b-vision" / "engine", manifest, "vision_encoder", device=device)
    px = np.random.default_rng(0).standard_normal((1, 3, 896, 896)).astype(np.float32)
    model = model.to(device)
    tpx = torch.from_numpy(px).to(device, torch.bfloat16)
    prog = graph.session

    def ours():
        prog.program.run({"pixel_values": torch.from_numpy(px).to(device)})

    def theirs():
        model.get_image_features(pixel_values=tpx)

    with torch.inference_mode():
        row["llmc_ms"] = round(time_cuda(ours, 10) * 1e3, 2)
        row["transformers_ms"] = round(time_cuda(theirs, 10) * 1e3, 2)
    row["speedup"] = round(row["transformers_ms"] / row["llmc_ms"], 3)
    row["ok"] = True
    return row


def run_images(smoke: bool, device: str, time_cuda=None) -> dict:
    import tempfile

    if smoke:
        return {"ok": True, "skipped": "no GPU (--cpu-smoke); tests/test_vlm_cuda.py runs these programs on the CPU"}
    work = Path(tempfile.mkdtemp(prefix="llmc-gpu-images-"))
    out: dict = {}
    try:
        out["llava"] = _llava(work)
    except Exception as exc:  # noqa: BLE001 - recorded; the speed part still runs
        out["llava"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(f"  images llava: {out['llava']}", flush=True)
    if time_cuda is not None:
        try:
            out["speed"] = _speed(work, time_cuda)
        except Exception as exc:  # noqa: BLE001
            out["speed"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"  images speed: {out['speed']}", flush=True)
    out["ok"] = all(v.get("ok") for v in out.values() if isinstance(v, dict))
    return out
