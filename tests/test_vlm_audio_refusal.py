"""Issue 49 item 6: a checkpoint with an audio encoder beside its vision encoder (Gemma 4's E2B/E4B layout) is
refused before any work by an image build, naming the encoder, and builds its text model with --text-only, which
the manifest records (both encoders left out)."""

from __future__ import annotations

import copy

import pytest

from llmc.compiler.build import BuildOptions, build
from llmc.errors import UnsupportedError
from llmc.testing.vlm import VLM_CONFIGS, write_processor

torch = pytest.importorskip("torch")


def test_audio_encoder_is_refused_by_name_and_text_only_builds(tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText

    fields = copy.deepcopy(VLM_CONFIGS["gemma4"][0])
    fields["audio_config"] = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(AutoConfig.for_model("gemma4", **fields)).save_pretrained(tmp_path / "c")
    write_processor("gemma4", tmp_path / "c")
    with pytest.raises(UnsupportedError, match=r"has audio_config beside its vision encoder.*--text-only"):
        build(tmp_path / "c", tmp_path / "e", BuildOptions())
    assert not (tmp_path / "e").exists()
    built = build(tmp_path / "c", tmp_path / "t", BuildOptions(text_only=True))
    assert built.manifest["multimodal"]["encoders_left_out"] == ["vision_config", "audio_config"]
