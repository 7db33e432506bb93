"""Every failure a user can cause: one line naming the file/field and the fix, non-zero exit, no partial output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_console_script_end_to_end(tmp_path, tiny_llama):
    """The installed `llmc` command: build with --json, run with --json (real subprocesses)."""
    llmc = shutil.which("llmc") or str(Path(sys.executable).parent / "llmc")
    out = tmp_path / "engine"
    built = subprocess.run([llmc, "build", str(tiny_llama), "-o", str(out), "--json"], capture_output=True,
                           text=True, check=True)
    result = json.loads(built.stdout)
    assert result["status"] == "ok" and Path(result["artifact"]) == out
    assert "[1/5]" in built.stderr
    ran = subprocess.run([llmc, "run", str(out), "--prompt", "The for statement", "-n", "8", "--json"],
                         capture_output=True, text=True, check=True)
    obj = json.loads(ran.stdout)
    assert len(obj["token_ids"]) == 8 and isinstance(obj["text"], str) and obj["timings"]["generate_s"] > 0
    assert subprocess.run([llmc, "verify", str(out)], capture_output=True).returncode == 0
