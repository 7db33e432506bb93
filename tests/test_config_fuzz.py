"""config.json fuzzed by JSON type: every field of the tiny fixture's config, in turn, holds a value of each other
JSON type. A build either succeeds (transformers ignores or accepts the value) or ends in one line naming the
field, exit 2 or 3, nothing left behind; never an internal error (exit 70)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli

# One value of each JSON type. The number is a non-integer where the field holds an integer (a count must be
# whole) and an integer elsewhere.
VALUES = {"null": None, "boolean": True, "string": "big", "number": 3, "array": [2], "object": {}}

# The fields of tests/conftest.py's tiny_llama config.json; test_fuzz_covers_every_fixture_field keeps this in step.
FIELDS = (
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "dtype", "eos_token_id", "head_dim",
    "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias",
    "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id",
    "pretraining_tp", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "transformers_version", "use_cache",
    "vocab_size",
)

# Fields the fixture lacks that llmc itself reads (sections, quantization, windows, experts), added one at a time.
ABSENT_FIELDS = ("text_config", "quantization_config", "sliding_window", "layer_types", "num_local_experts",
                 "num_experts_per_tok")


def _kind(value: object) -> str:
    """The JSON type of ``value`` as the JSON spec names it (one number type)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _checkpoint_with(src: Path, dst: Path, config: object) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done", "*.lock", "config.json"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _build(ckpt: Path, out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(out), "-q"])
    return result.exit_code, result.stderr


def _assert_one_error_line(code: int, err: str, out: Path, *needles: str) -> None:
    assert code in (2, 3), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [line for line in err.splitlines() if line.strip() and not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "temporary build directory left behind"


def test_fuzz_covers_every_fixture_field(tiny_llama):
    assert sorted(json.loads((tiny_llama / "config.json").read_text())) == sorted(FIELDS)


@pytest.mark.parametrize("field", FIELDS + ABSENT_FIELDS)
def test_field_of_every_other_type(field, tiny_llama, tmp_path):
    base = json.loads((tiny_llama / "config.json").read_text())
    current = _kind(base[field]) if field in base else "absent"
    for kind, value in VALUES.items():
        if kind == current == "number":
            if isinstance(base[field], float):
                continue
            value = 2.5  # an integer field given a number that is not whole
        elif kind == current:
            continue
        where = tmp_path / kind
        ckpt = _checkpoint_with(tiny_llama, where / "ckpt", {**base, field: value})
        code, err = _build(ckpt, where / "out")
        if code == 0:  # transformers reads the field as it is (an unused or optional field): a real engine
            assert (where / "out" / "manifest.json").is_file()
            continue
        _assert_one_error_line(code, err, where / "out", field, "config.json")


@pytest.mark.parametrize("config", [[], 3, "x", None, True, [{"model_type": "llama"}]], ids=json.dumps)
def test_config_that_is_not_an_object(config, tiny_llama, tmp_path):
    ckpt = _checkpoint_with(tiny_llama, tmp_path / "ckpt", config)
    code, err = _build(ckpt, tmp_path / "out")
    _assert_one_error_line(code, err, tmp_path / "out", "config.json", f"JSON {_kind(config)}", "not an object")
    assert code == 2
