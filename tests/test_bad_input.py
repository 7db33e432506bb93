"""Every failure a user can cause: one line naming the file/field and the fix, non-zero exit, no partial output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli


def _llmc(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stderr if hasattr(result, "stderr") else result.output


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done", "*.lock"))
    return dst


def _assert_clean_failure(code: int, err: str, out_dir: Path, *needles: str) -> None:
    assert code not in (0, 70), (code, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    assert not out_dir.exists()
    assert not list(out_dir.parent.glob(f".{out_dir.name}.tmp-*")), "temporary build directory left behind"


def test_missing_directory(tmp_path):
    code, err = _llmc("build", str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "nope", "config.json")


def test_no_config_json(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "config.json", "missing")


def test_unsupported_model_type_lists_supported(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "not-a-transformers-model"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "model_type", "'not-a-transformers-model'", "llama", "gpt2")
    assert code == 3


def test_truncated_safetensors(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "model.safetensors", "truncated")


def test_corrupt_safetensors_header(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"\xff" * 32
    weights.write_bytes(bytes(data))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "model.safetensors", "corrupt")


def test_shape_disagrees_with_config(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _assert_clean_failure(code, err, tmp_path / "out", "model.safetensors", "mlp", "shape", "intermediate_size")


def test_output_exists_without_force(tmp_path, tiny_llama):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _llmc("build", str(tiny_llama), "-o", str(out))
    assert code == 2 and "--force" in err and "already exists" in err
    assert (out / "keep.txt").read_text() == "user data"


def test_bad_block_size(tmp_path, tiny_llama):
    code, err = _llmc("build", str(tiny_llama), "-o", str(tmp_path / "out"), "--block-size", "12")
    _assert_clean_failure(code, err, tmp_path / "out", "--block-size", "power of two")


def test_unknown_target(tmp_path, tiny_llama):
    code, err = _llmc("build", str(tiny_llama), "-o", str(tmp_path / "out"), "--target", "tpu9")
    _assert_clean_failure(code, err, tmp_path / "out", "--target", "cpu")


@pytest.mark.parametrize("damage", ["modify", "delete"])
def test_run_refuses_damaged_engine(tmp_path, tiny_engine, damage):
    engine = _copy(tiny_engine, tmp_path / "engine")
    victim = engine / "model.onnx.data"
    if damage == "modify":
        data = bytearray(victim.read_bytes())
        data[100] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    code, err = _llmc("run", str(engine), "--prompt", "hello", "-n", "4")
    assert code == 2 and "model.onnx.data" in err and ("modified" in err or "missing" in err), err
    code, err = _llmc("verify", str(engine))
    assert code == 1 and "model.onnx.data" in err


def test_run_on_missing_engine(tmp_path):
    code, err = _llmc("run", str(tmp_path / "nothing"), "--prompt", "x")
    assert code == 2 and "nothing" in err and "llmc build" in err


def test_a_missing_compiled_part_is_an_install_error_not_a_bug(tiny_engine, monkeypatch):
    """llmc's ONNX Runtime op library absent (an install that skipped the C++ build): `llmc run` ends in one line
    naming the library and how to rebuild it, exit 6, and the error is still an ImportError for code that falls
    back on it."""
    import importlib.util

    from llmc.errors import EXIT_INSTALL, InstallError
    from llmc.plugins.paged_attention import ort_native

    real = importlib.util.find_spec
    monkeypatch.setattr(ort_native, "_path", None)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == ort_native.LIBRARY_MODULE else real(name, *a))
    with pytest.raises(ImportError) as info:
        ort_native.library_path()
    assert isinstance(info.value, InstallError) and info.value.exit_code == EXIT_INSTALL == 6
    code, err = _llmc("run", str(tiny_engine), "--prompt", "hello", "-n", "2")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 6 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert ort_native.LIBRARY_MODULE in err and "pip install" in err and "internal error" not in err


def test_console_script_end_to_end(tmp_path, tiny_llama):
    """The installed `llmc` command: build with --json, run with --json (real subprocesses)."""
    llmc = shutil.which("llmc") or str(Path(sys.executable).parent / "llmc")
    out = tmp_path / "engine"
    built = subprocess.run([llmc, "build", str(tiny_llama), "-o", str(out), "--json"], capture_output=True,
                           text=True, check=True)
    result = json.loads(built.stdout)
    assert result["status"] == "ok" and Path(result["artifact"]) == out
    assert "[1/5]" not in built.stderr  # --json: the one object on stdout, no progress lines on stderr
    ran = subprocess.run([llmc, "run", str(out), "--prompt", "The for statement", "-n", "8", "--json"],
                         capture_output=True, text=True, check=True)
    obj = json.loads(ran.stdout)
    assert len(obj["token_ids"]) == 8 and isinstance(obj["text"], str) and obj["timings"]["generate_s"] > 0
    assert subprocess.run([llmc, "verify", str(out)], capture_output=True).returncode == 0


# -- checkpoint <-> config <-> graph accounting (exit 2 before tracing, one line, nothing left) ----------

def _edit_config(ckpt: Path, **fields) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(fields)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(ckpt: Path, edit) -> None:
    """Rewrite model.safetensors with ``edit(dict of numpy arrays)`` applied."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


def _refused_before_export(code: int, err: str, out: Path, *needles: str) -> None:
    _assert_clean_failure(code, err, out, *needles)
    assert code == 2, err
    assert "[3/5]" not in err, "refused before the graph was traced"


@pytest.mark.parametrize("fields, needles", [
    ({"num_hidden_layers": -1}, ("'num_hidden_layers' is -1", "positive integer", "set it to 2")),
    ({"num_hidden_layers": 0}, ("'num_hidden_layers' is 0", "set it to 2")),
    ({"num_key_value_heads": 3}, ("'num_attention_heads' (4)", "'num_key_value_heads' (3)")),
    ({"hidden_size": 66, "head_dim": None}, ("'hidden_size' (66)", "'num_attention_heads' (4)", "head_dim")),
    ({"vocab_size": "512"}, ("'vocab_size' is \"512\"", "positive integer")),
    ({"num_local_experts": 2, "num_experts_per_tok": 3}, ("'num_experts_per_tok' (3)", "'num_local_experts' (2)")),
], ids=["layers-negative", "layers-zero", "kv-heads", "head-width", "vocab-string", "experts"])
def test_config_sanity_before_any_work(tmp_path, tiny_llama, fields, needles):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_config(ckpt, **fields)
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "config.json", *needles)
    assert "[2/5]" not in err, "refused before the model was even built"


def test_transformers_config_validation_is_one_line(tmp_path, tiny_llama):
    """transformers' own validators (multi-line messages) still end in one error line."""
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_config(ckpt, hidden_size=66)  # head_dim stays 16: llmc's check passes, transformers' does not
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "config.json", "transformers cannot read it",
                           "hidden size (66)")


def test_checkpoint_with_an_extra_layer(tmp_path, tiny_llama):
    """Weights of a 3-layer model under a 2-layer config: the surplus tensors and the field are named."""
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")

    def add_layer(t):
        for name in [n for n in t if n.startswith("model.layers.1.")]:
            t[name.replace("layers.1.", "layers.2.")] = t[name].copy()
    _edit_tensors(ckpt, add_layer)
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "does not use", "'model.layers.2.", "num_hidden_layers",
                           "layers 0..2")


def test_checkpoint_with_an_unknown_tensor(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": np.ones((4, 4), np.float32)}))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "1 checkpoint tensor", "'model.layers.0.mlp.extra_proj.weight'",
                           "model_type 'llama'")


def test_checkpoint_with_a_missing_tensor(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "'model.layers.1.mlp.down_proj.weight'", "no safetensors")


def test_checkpoint_missing_whole_layers_names_the_layer_count(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_config(ckpt, num_hidden_layers=3)
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "'model.layers.2.", "'num_hidden_layers' is 3",
                           "layers 0..1")


def test_missing_output_projection_names_tie_word_embeddings(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "'lm_head.weight'", "tie_word_embeddings")


def test_tensor_shape_disagrees_with_vocab_size(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_config(ckpt, vocab_size=600)
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "model.safetensors", "shape [512, 64]", "[600, 64]",
                           "vocab_size gives 600, the checkpoint has 512")


def test_integer_weights_are_refused(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int8)}))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "'model.norm.weight'", "int8", "quantization_config")


def test_known_unused_tensors_are_accepted(tmp_path, tiny_llama, tiny_engine):
    """Rotary tables some checkpoints store are known unused: the engine is the same as without them."""
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_tensors(ckpt, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq":
                                            np.ones(8, np.float32) for i in range(2)}))
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    assert code == 0, err
    from llmc.runtime import Engine, SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = Engine.load(tmp_path / "out").generate([[5, 6, 7]], params)[0].token_ids
    assert got == Engine.load(tiny_engine).generate([[5, 6, 7]], params)[0].token_ids


def test_tokenizer_larger_than_the_vocabulary(tmp_path, tiny_llama):
    """A tokenizer whose ids run past vocab_size belongs to another model: refused before any work."""
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    _edit_config(ckpt, vocab_size=500)  # the tokenizer has 512 tokens (and the embedding 512 rows)
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "tokenizer.json", "id 511", "'vocab_size' is 500")
    assert "[2/5]" not in err


def test_unreadable_tokenizer(tmp_path, tiny_llama):
    ckpt = _copy(tiny_llama, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text('{"model": ')
    code, err = _llmc("build", str(ckpt), "-o", str(tmp_path / "out"))
    _refused_before_export(code, err, tmp_path / "out", "tokenizer.json", "unreadable")
