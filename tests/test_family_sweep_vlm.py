"""The family sweep's image-text-to-text section (scripts/family_sweep.py --mapping image-text-to-text, issue 49
item 6): a vision-language wrapper's tiny random checkpoint from its own config class (text model and encoders made
small, special tokens inside the small vocabulary), built --text-only, compared with the wrapper's own generate on
text-only prompts; a wrapper llmc cannot lower ends refused in one line. docs/family_sweep_vlm.md holds the sweep over
every type; tests/test_family_sweep.py tests the causal-LM section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "family_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("family_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wrappers_config_is_small_and_its_special_tokens_lie_apart(sweep):
    llava = sweep.tiny_vlm_config("llava").to_dict()
    assert llava["text_config"]["vocab_size"] == sweep.VOCAB and llava["text_config"]["hidden_size"] == 64
    vision = llava["vision_config"]
    assert (vision["hidden_size"], vision["num_hidden_layers"], vision["intermediate_size"]) == (64, 2, 128)
    assert llava["image_token_index"] < sweep.VOCAB  # moved from 32000 into the small vocabulary
    assert llava["image_token_index"] not in sweep.prompt_ids(llava, sweep.VOCAB)

    # Qwen2-VL: its placeholders apart from each other, and M-RoPE sections of the small heads (half of 16)
    qwen = sweep.tiny_vlm_config("qwen2_vl").to_dict()
    ids = [qwen[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    assert len(set(ids)) == 4 and max(ids) < sweep.VOCAB
    assert not set(ids) & set(sweep.prompt_ids(qwen, sweep.VOCAB))
    assert sum(qwen["text_config"]["rope_parameters"]["mrope_section"]) == 8
    # an encoder's output width follows the text model's (Qwen's merger projects into it)
    assert qwen["vision_config"]["hidden_size"] == qwen["text_config"]["hidden_size"] == 64


def test_text_only_build_of_a_wrapper_matches_its_own_generate(sweep, tmp_path):
    row = sweep.run_one("llava", tmp_path, sweep.IMAGE_TEXT, self_check=False, image_build=False)
    assert row["outcome"] == "match", row
    assert row["tokens_compared"] == len(sweep.PROMPT_LENGTHS) * sweep.GREEDY_TOKENS  # tokens compared, all equal
    assert row["model_class"] == "LlavaForConditionalGeneration" and row["text_model_type"] == "llama"
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["multimodal"]["text_only"] is True
    assert manifest["multimodal"]["wrapper"] == "LlavaForConditionalGeneration"


def test_a_wrapper_llmc_cannot_lower_is_refused_in_one_line(sweep, tmp_path):
    row = sweep.run_one("blip-2", tmp_path, sweep.IMAGE_TEXT, self_check=False)
    assert row["outcome"] == "refused" and row["exit_code"] == 3, row
    assert "\n" not in row["reason"] and "does not lower multimodal models" in row["reason"], row
    assert "pixel_values" in row["text_forward_error"]  # transformers' own wrapper needs the image too


def test_the_table_counts_each_outcome(sweep):
    meta = {"mapping": sweep.IMAGE_TEXT, "updated_at": "now", "llmc": "0", "transformers": "5", "torch": "2",
            "types_total": 103}
    rows = {"llava": {"outcome": "match", "reason": "fusions: none", "text_model_type": "llama",
                      "image_build": "built, with vision_encoder (1 s)"},
            "blip-2": {"outcome": "refused", "reason": "<checkpoint>: model_type 'blip-2': no | yes"}}
    table = sweep.render_markdown({"meta": meta, "rows": rows})
    assert "**2 of 103 model types** in transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES` run: 1 match, " \
           "1 refused." in table
    assert "| llava | llama | match | fusions: none | built, with vision_encoder (1 s) |" in table
    assert "| blip-2 | opt |" not in table and "model_type 'blip-2': no \\| yes |  |" in table
