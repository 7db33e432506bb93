"""What the image-text-to-text family sweep found (docs/family_sweep_vlm.md), held here at unit level:

- the self-check's twin cuts an encoder's per-layer lists with its layer count (LFM3-VL, Muse: transformers refused
  a one-layer vision tower with 14 ``layer_types``, an internal error);
- a model type transformers registers under image-text-to-text only (Mistral 4, no ``text_config``) is built with
  that auto class (it was refused: AutoModelForCausalLM does not know its config);
- latent attention's zero ``head_dim`` / ``qk_rope_head_dim`` (GLM-5 Next's defaults) and a list of expert sizes
  (ERNIE 4.5-VL's ``moe_intermediate_size``) are not bad input; a zero ``head_dim`` without latent attention is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.compiler import config_check, multimodal, selfcheck
from llmc.errors import LlmcError


def test_the_twin_cuts_an_encoders_layer_types():
    config = {"model_type": "lfm3_vl",
              "text_config": {"model_type": "lfm3", "hidden_size": 256, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "vocab_size": 1000},
              "vision_config": {"num_hidden_layers": 14, "layer_types": ["full_attention", "sliding_attention"] * 7,
                                "hidden_size": 64}}
    twin = selfcheck.shrink_config(config)
    assert twin["vision_config"]["num_hidden_layers"] == 1
    assert twin["vision_config"]["layer_types"] == ["full_attention"]


def test_a_type_registered_under_image_text_only_builds_with_that_class():
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    assert multimodal.auto_class({"model_type": "mistral4", "hidden_size": 64}) is AutoModelForImageTextToText
    assert multimodal.auto_class({"model_type": "llama", "hidden_size": 64}) is AutoModelForCausalLM


def _base(**fields) -> dict:
    return {"model_type": "x", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 128, "vocab_size": 512, **fields}


def test_latent_attention_zero_head_sizes_and_expert_size_lists_are_not_bad_input():
    path = Path("ckpt/config.json")
    config_check.check_config(_base(kv_lora_rank=16, head_dim=0, qk_rope_head_dim=0, qk_nope_head_dim=16,
                                    v_head_dim=16), path)
    config_check.check_config(_base(moe_intermediate_size=[32, 16]), path)
    with pytest.raises(LlmcError, match="field 'head_dim' is 0; it must be a positive integer"):
        config_check.check_config(_base(head_dim=0), path)
    with pytest.raises(LlmcError, match="moe_intermediate_size"):
        config_check.check_config(_base(moe_intermediate_size=[32, 0]), path)


def test_a_wrapper_with_per_expert_tensors_builds_and_matches(tmp_path):
    """Qwen3.5-MoE as its wrapper saves it (one tensor per expert, which transformers merges on load): the trace's
    weights come from the wrapper class's own load (it looked them up in a causal LM's state dict: bad input)."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "family_sweep.py"
    spec = importlib.util.spec_from_file_location("family_sweep", script)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    row = sweep.run_one("qwen3_5_moe", tmp_path, sweep.IMAGE_TEXT, self_check=False, image_build=False)
    assert row["outcome"] == "match", row
    assert row["tokens_compared"] == len(sweep.PROMPT_LENGTHS) * sweep.GREEDY_TOKENS
    names = [n for f in sorted((tmp_path / "checkpoint").glob("*.safetensors")) for n in _safetensors_names(f)]
    assert any(".experts.0." in n for n in names)  # the fixture really stores per-expert tensors


def _safetensors_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return list(f.keys())
