"""Pre-quantized checkpoints (compiler/prequantized.py): FP8 ones are dequantized exactly and build engines that
match transformers running the same dequantized weights; every other method is refused before any work."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams

PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2])
BLOCK = (24, 40)  # divides none of the tiny model's widths: ragged edge blocks on both axes


def _linear_names(state):
    return [n for n, t in state.items() if t.dim() == 2 and "proj" in n]


def _quantize(w, how: str):
    """E4M3 codes and float32 scales of a ``[N, K]`` float32 weight; ``how``: block | channel | tensor. The
    scales are made independently of llmc: torch's own conversion and tiling."""
    import torch

    fmax = 448.0
    if how == "tensor":
        scale = w.abs().max() / fmax
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1), scale
    if how == "channel":
        scale = w.abs().amax(1, keepdim=True) / fmax
        return (w / scale).to(torch.float8_e4m3fn), scale, scale
    n, k = w.shape
    bn, bk = BLOCK
    nb, kb = -(-n // bn), -(-k // bk)
    scale = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / fmax
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale, full


def _fp8_checkpoint(src, out, how: str):
    """``src`` with every projection stored as E4M3 plus scales, in the format ``how`` names; returns the
    checkpoint and the dequantized state (what transformers should run)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    dequantized = dict(state)
    for name in _linear_names(state):
        codes, scale, full = _quantize(state[name].float(), how)
        state[name] = codes
        dequantized[name] = codes.float() * full
        if how == "block":
            state[name + "_scale_inv"] = scale
        else:
            state[name + "_scale"] = scale
            state[name.removesuffix(".weight") + ".input_scale"] = torch.tensor([0.01])  # static activations
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if how == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": list(BLOCK)}
    else:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                          "type": "float", "num_bits": 8, "strategy": how}}}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, dequantized


@pytest.mark.parametrize("how", ["block", "channel", "tensor"])
def test_fp8_checkpoint_builds_an_engine_that_matches_transformers_on_its_dequantized_weights(how, tmp_path,
                                                                                             tiny_llama):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, dequantized = _fp8_checkpoint(tiny_llama, tmp_path / "fp8", how)
    result = build(ckpt, tmp_path / "e", BuildOptions())
    source = result.report["source_quantization"]
    assert source["tensors_dequantized"] == len(_linear_names(dequantized)) and source["method"] in ("fp8",
                                                                                                  "compressed-tensors")
    assert source["dropped"] == (0 if how == "block" else source["tensors_dequantized"])
    config = AutoConfig.from_pretrained(tiny_llama)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict(dequantized, strict=False)
    hf.tie_weights()
    engine = Engine.load(result.out_dir)
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    ids = np.random.default_rng().integers(3, engine.vocab_size, 40).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(engine.score(ids) - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.parametrize("quant_method, flag", [("awq", "--quant int4-awq"), ("gptq", "--quant int4-gptq"),
                                                ("mxfp4", "--quant nvfp4"), ("bitsandbytes", "--quant int4")])
def test_other_prequantized_checkpoints_are_refused_naming_the_flag(quant_method, flag, tmp_path, tiny_llama):
    ckpt = tmp_path / "q"
    shutil.copytree(tiny_llama, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": quant_method, "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(tmp_path / "e"), "-q"])
    assert r.exit_code == 3, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and quant_method in line and flag in line, line
    assert not (tmp_path / "e").exists()


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path, tiny_llama):
    ckpt, _ = _fp8_checkpoint(tiny_llama, tmp_path / "fp8", "block")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(tmp_path / "e"), "-q"])
    assert r.exit_code == 2 and "no quantization_config" in r.output, r.output
    assert not (tmp_path / "e").exists()
