"""Vision-language checkpoints as they ship (issue 49 item 1): the text model of each wrapper, built from the
wrapper's own modules and weights with --text-only, decodes exactly as transformers' multimodal model does on text;
without --text-only the build is refused before any work, naming the encoders it would leave out (but for the
families whose images llmc places: compiler/vision_encoder.py, tests/test_vlm_images.py)."""

from __future__ import annotations

import json

import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.compiler.vision_encoder import IMAGE_FAMILIES
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime import Engine, SamplingParams
from llmc.testing.greedy import PROMPTS
from llmc.testing.vlm import VLM_CONFIGS, text_greedy, write_tiny_vlm


@pytest.mark.parametrize("model_type", sorted(VLM_CONFIGS))
def test_text_model_of_the_wrapper_matches_transformers(model_type, tmp_path):
    hf = write_tiny_vlm(model_type, tmp_path / "ckpt", seed=11)
    if model_type not in IMAGE_FAMILIES:  # those build with their encoder: tests/test_vlm_images.py
        with pytest.raises(UnsupportedError, match="--text-only"):
            build(tmp_path / "ckpt", tmp_path / "refused", BuildOptions())
        assert not (tmp_path / "refused").exists()

    built = build(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(text_only=True))
    section = built.manifest["multimodal"]
    assert section["text_only"] is True and section["wrapper"] == type(hf).__name__
    assert "vision_config" in section["encoders_left_out"]
    engine = Engine.load(tmp_path / "engine")
    outs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == text_greedy(hf, PROMPTS, 32)


def test_text_only_on_a_text_model_is_a_bad_flag(tiny_llama, tmp_path):
    with pytest.raises(LlmcError, match="has no encoder"):
        build(tiny_llama, tmp_path / "e", BuildOptions(text_only=True))


def test_cli_text_only_flag_and_manifest(tmp_path):
    # The command's own entry (click's runner): a process of its own would add a start of torch, transformers and
    # torch.export to each command; tests/test_bad_input.py runs the installed console script.
    from click.testing import CliRunner

    from llmc.cli.main import cli

    def llmc(*args):
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        return result

    write_tiny_vlm("idefics3", tmp_path / "ckpt", seed=2)  # no tokenizer: its images refused, --text-only builds
    refused = llmc("build", tmp_path / "ckpt", "-o", tmp_path / "e", "--json")
    assert refused.exit_code == 3 and "--text-only" in refused.stdout + refused.stderr
    ok = llmc("build", tmp_path / "ckpt", "-o", tmp_path / "e", "--json", "--text-only")
    assert ok.exit_code == 0, ok.stderr
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["multimodal"]["wrapper"] == "Idefics3ForConditionalGeneration"
    shown = llmc("inspect", tmp_path / "e")
    assert shown.exit_code == 0 and "Idefics3ForConditionalGeneration built --text-only" in shown.stdout


@pytest.mark.parametrize("model_type,text_only", [("qwen3_5", False), ("gemma3", True)])
def test_vision_language_builds_pass_the_self_check(model_type, text_only, tmp_path, monkeypatch,
                                                    vlm_checked_image_build):
    """A user's build runs the self-check: the twin of a wrapper is the wrapper (text model shrunk, encoders cut to
    one layer; an image build's twin with its encoder graph) and must match transformers on text. The image build
    is the session's (tests/conftest.py: built with the check on, in a cache of its own; tests/test_vlm_qwen_images.py
    runs its engine)."""
    if not text_only:
        root = vlm_checked_image_build(model_type)
        manifest, report, info = (json.loads((root / "engine" / f).read_text())
                                  for f in ("manifest.json", "report.json", "build_info.json"))
    else:
        monkeypatch.setenv("LLMC_SELF_CHECK", "1")
        monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
        write_tiny_vlm(model_type, tmp_path / "ckpt", seed=5)
        built = build(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(text_only=text_only))
        manifest, report, info = built.manifest, built.report, built.build_info
    assert ("vision_encoder" in manifest.get("graphs", {})) is not text_only
    assert report["self_check"]["result"] == "passed"
    assert info["self_check"]["status"] == "passed"


@pytest.mark.parametrize("model_type", ["qwen3_5", "gemma3", "llama4"])
def test_twins_of_released_size_wrappers_run_in_transformers(model_type):
    """transformers' own default config of the wrapper (released sizes) shrinks into a twin transformers builds and
    runs on text, the encoders' output widths following the twin's text width."""
    import torch
    from transformers import AutoConfig

    from llmc.compiler.multimodal import auto_class
    from llmc.compiler.selfcheck import shrink_config

    config = AutoConfig.for_model(model_type).to_dict()
    twin = shrink_config(config)
    assert twin["text_config"]["hidden_size"] < config["text_config"]["hidden_size"]
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in twin.items() if k != "model_type"})
    cfg.text_config.vocab_size = 256  # the twin keeps the vocabulary; a small one keeps this test quick
    with torch.device("meta"):
        model = auto_class(twin).from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) < 400e6
    del model
    tiny = auto_class(twin).from_config(cfg).eval()
    with torch.no_grad():
        logits = tiny(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_quantized_text_only_builds(tmp_path):
    """RTN int4 builds a wrapper's text model with its accuracy report; calibrated recipes calibrate through the
    wrapper's own class (LLaVA, whose causal-LM class is none, and Gemma 3, its own causal LM)."""
    from llmc.quant.recipe import QuantRecipe
    from llmc.testing.corpus import save_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer(vocab_size=512, model_max_length=512)
    for model_type in ("llava", "gemma3"):
        write_tiny_vlm(model_type, tmp_path / model_type, seed=4)
        save_tokenizer(tok, tmp_path / model_type)
    built = build(tmp_path / "llava", tmp_path / "int4", BuildOptions(text_only=True, quant=QuantRecipe(quant="int4")))
    assert built.report["accuracy"]["kl_mean"] >= 0
    fp8 = build(tmp_path / "llava", tmp_path / "fp8", BuildOptions(text_only=True, quant=QuantRecipe(quant="fp8")))
    assert fp8.report["accuracy"]["top1_agreement"] > 0.5 and fp8.report["quantization"]["calibration"]["tokens"]
    fp8 = build(tmp_path / "gemma3", tmp_path / "g-fp8", BuildOptions(text_only=True, quant=QuantRecipe(quant="fp8")))
    assert fp8.report["accuracy"]["top1_agreement"] > 0.5
