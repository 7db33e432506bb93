"""`llmc verify`, `llmc pack` and `llmc unpack` on copies of a built tiny engine, and hostile archives."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.build_cache import archive
from llmc.cli.main import cli
from llmc.runtime import Engine, SamplingParams, artifact

LLMC = shutil.which("llmc") or str(Path(sys.executable).parent / "llmc")


def _llmc(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done", "*.lock"))
    return dst


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


# -- verify ---------------------------------------------------------------------------------------

def test_verify_ok_reports_digest_and_loadability(tiny_engine):
    code, out, _ = _llmc("verify", tiny_engine, "--json")
    obj = json.loads(out)
    assert code == 0 and obj["ok"] and obj["problems"] == [] and obj["load_problems"] == []
    assert obj["schema_version"] == artifact.SCHEMA_VERSION and obj["backend"] == "onnxruntime"
    assert obj["artifact_digest"] == artifact.artifact_digest(tiny_engine)


@pytest.mark.parametrize("name", ["model.onnx.data", "model.onnx", "tokenizer.json", "report.json"])
def test_verify_catches_a_modified_byte(tiny_engine, tmp_path, name):
    engine = _copy(tiny_engine, tmp_path / "e")
    _flip(engine / name, at=min(100, (engine / name).stat().st_size - 1))
    code, out, err = _llmc("verify", engine)
    assert code == 1 and name in err and "modified" in err


def test_verify_catches_a_missing_file(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    (engine / "model.onnx.data").unlink()
    code, out, _ = _llmc("verify", engine, "--json")
    obj = json.loads(out)
    assert code == 1 and not obj["ok"] and any("model.onnx.data" in p and "missing" in p for p in obj["problems"])


def test_verify_catches_an_unlisted_file(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    (engine / "extra.onnx").write_bytes(b"planted")
    code, _, err = _llmc("verify", engine)
    assert code == 1 and "extra.onnx" in err and "not listed" in err


def test_verify_ignores_only_the_declared_build_info(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    info = json.loads((engine / artifact.BUILD_INFO).read_text())
    assert set(info) >= {"timings_s", "built_at", "host"}
    (engine / artifact.BUILD_INFO).write_text(json.dumps({**info, "host": "elsewhere"}))
    assert _llmc("verify", engine)[0] == 0
    # A manifest that does not declare it gets no exemption.
    manifest = json.loads((engine / artifact.MANIFEST).read_text())
    del manifest["build_info"]
    (engine / artifact.MANIFEST).write_text(json.dumps(manifest))
    code, _, err = _llmc("verify", engine)
    assert code == 1 and artifact.BUILD_INFO in err


@pytest.mark.parametrize("version, needle", [(artifact.SCHEMA_VERSION + 1, "newer llmc"), ("two", "rebuild")])
def test_verify_refuses_other_schemas(tiny_engine, tmp_path, version, needle):
    engine = _copy(tiny_engine, tmp_path / "e")
    manifest = json.loads((engine / artifact.MANIFEST).read_text())
    manifest["schema_version"] = version
    manifest["llmc_version"] = "9.0.0"
    (engine / artifact.MANIFEST).write_text(json.dumps(manifest))
    code, out, err = _llmc("verify", engine)
    assert code == 1 and "schema_version" in err and needle in err, err
    if needle == "newer llmc":
        assert "upgrade llmc" in err and "9.0.0" in err
        with pytest.raises(Exception, match="newer llmc"):
            Engine.load(engine)


def test_verify_refuses_a_manifest_path_outside_the_artifact(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    (tmp_path / "secret").write_text("x")
    manifest = json.loads((engine / artifact.MANIFEST).read_text())
    manifest["files"]["../secret"] = artifact.sha256_file(tmp_path / "secret")
    (engine / artifact.MANIFEST).write_text(json.dumps(manifest))
    code, _, err = _llmc("verify", engine)
    assert code == 1 and "../secret" in err and "outside" in err


def test_verify_says_what_a_gpu_engine_needs(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    manifest = json.loads((engine / artifact.MANIFEST).read_text())
    manifest["engine"]["backend"] = "tensorrt"
    manifest["target"] = {"name": "h100", "backend": "tensorrt", "sm": "9.0"}
    manifest["toolchain"]["tensorrt"] = "10.9.0"
    (engine / artifact.MANIFEST).write_text(json.dumps(manifest))
    code, out, _ = _llmc("verify", engine, "--json")
    obj = json.loads(out)
    assert code == 1 and obj["problems"] == []
    (problem,) = obj["load_problems"]
    assert "h100" in problem and "9.0" in problem and "TensorRT 10.9.0" in problem
    assert _llmc("verify", engine, "--integrity-only")[0] == 0


def test_verify_names_a_missing_runtime_library(tiny_engine, tmp_path):
    """A real process in which ONNX Runtime fails to import (shadowed on PYTHONPATH)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "onnxruntime.py").write_text("raise ImportError('simulated: not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([LLMC, "verify", str(tiny_engine)], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "onnxruntime" in proc.stderr and "pip install" in proc.stderr
    proc = subprocess.run([LLMC, "verify", str(tiny_engine), "--integrity-only"], capture_output=True, env=env)
    assert proc.returncode == 0


def test_verify_missing_directory_is_bad_input(tmp_path):
    code, _, err = _llmc("verify", tmp_path / "nope")
    assert code == 2 and "nope" in err


# -- pack / unpack --------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_pack_unpack_roundtrip_is_reproducible_and_runs(tiny_engine, tmp_path, suffix):
    a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    code, out, err = _llmc("pack", tiny_engine, "-o", a, "--json")
    assert code == 0, err
    assert json.loads(out)["artifact_digest"] == artifact.artifact_digest(tiny_engine)
    assert _llmc("pack", tiny_engine, "-o", b)[0] == 0
    assert a.read_bytes() == b.read_bytes(), "packing is reproducible"
    with tarfile.open(a) as tf:
        assert all(m.uid == 0 and m.mtime == 0 and not m.name.startswith(("/", "..")) for m in tf.getmembers())
    code, out, err = _llmc("unpack", a, "-o", tmp_path / "engine", "--json")
    assert code == 0 and json.loads(out)["ok"], err
    for f in tiny_engine.iterdir():
        if f.is_file() and not f.name.startswith("."):
            assert (tmp_path / "engine" / f.name).read_bytes() == f.read_bytes(), f.name
    eng = Engine.load(tmp_path / "engine")
    assert len(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_pack_refuses_a_damaged_engine_and_an_existing_archive(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    _flip(engine / "model.onnx.data")
    code, _, err = _llmc("pack", engine, "-o", tmp_path / "x.tar")
    assert code == 1 and "model.onnx.data" in err and not (tmp_path / "x.tar").exists()
    (tmp_path / "y.tar").write_bytes(b"keep")
    code, _, err = _llmc("pack", tiny_engine, "-o", tmp_path / "y.tar")
    assert code == 2 and "--force" in err and (tmp_path / "y.tar").read_bytes() == b"keep"
    assert _llmc("pack", tiny_engine, "-o", tmp_path / "z.zip")[0] == 2


def _add_file(tf: tarfile.TarFile, name: str, data: bytes = b"x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _crafted(tmp_path: Path, tiny_engine: Path, evil) -> Path:
    """A real engine archive with a hostile member appended by ``evil(tarfile)``."""
    path = tmp_path / "evil.tar"
    archive.pack(tiny_engine, path)
    with tarfile.open(path, "a") as tf:
        evil(tf)
    return path


def _symlink(name: str, target: str):
    def add(tf):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tf.addfile(info)
    return add


def _hardlink(name: str, target: str):
    def add(tf):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.LNKTYPE, target
        tf.addfile(info)
    return add


def _device(name: str):
    def add(tf):
        info = tarfile.TarInfo(name)
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        tf.addfile(info)
    return add


def _two(*adders):
    def add(tf):
        for a in adders:
            a(tf)
    return add


@pytest.mark.parametrize("evil, needle", [
    (lambda tf: _add_file(tf, "../escaped.txt"), "'..'"),
    (lambda tf: _add_file(tf, "sub/../../escaped.txt"), "'..'"),
    (lambda tf: _add_file(tf, "/tmp/llmc-absolute-escape.txt"), "absolute"),
    (_symlink("link", "../../outside"), "outside the target"),
    (_symlink("abs", "/etc"), "outside the target"),
    # The classic two-step: a symlink to a directory outside, then a file written through it.
    (_two(_symlink("d", ".."), lambda tf: _add_file(tf, "d/escaped.txt")), "symlink"),
    (_hardlink("h", "../../etc/passwd"), "hard link"),
    (_device("null"), "device"),
    (lambda tf: _add_file(tf, "model.onnx", b"second copy"), "twice"),
], ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "symlink-abs", "symlink-then-file",
        "hardlink-out", "device", "duplicate"])
def test_unpack_refuses_hostile_members(tiny_engine, tmp_path, evil, needle):
    work = tmp_path / "work"
    work.mkdir()
    tar = _crafted(tmp_path, tiny_engine, evil)
    out = work / "engine"
    code, _, err = _llmc("unpack", tar, "-o", out)
    assert code == 2 and needle in err and "refusing" in err, err
    assert not out.exists() and list(work.iterdir()) == [], "nothing extracted, no temporary left"
    assert not (tmp_path / "escaped.txt").exists() and not Path("/tmp/llmc-absolute-escape.txt").exists()


@pytest.mark.skipif(not hasattr(tarfile, "data_filter"), reason="tarfile's data filter exists from Python 3.11.4")
def test_data_filter_is_a_second_guard(tiny_engine, tmp_path, monkeypatch):
    """With llmc's own member checks switched off, tarfile's 'data' filter still refuses a '..' member."""
    monkeypatch.setattr(archive, "check_member", lambda member: None)
    work = tmp_path / "work"
    work.mkdir()
    tar = _crafted(tmp_path, tiny_engine, lambda tf: _add_file(tf, "../escaped.txt"))
    code, _, err = _llmc("unpack", tar, "-o", work / "engine")
    assert code == 2 and "'../escaped.txt'" in err and "refusing" in err, err
    assert list(work.iterdir()) == [] and not (tmp_path / "escaped.txt").exists()


def _without_data_filter(monkeypatch) -> None:
    """This Python as 3.11.0-3.11.3 (Debian 12 ships 3.11.2): tarfile has no extraction filters."""
    monkeypatch.setattr(archive, "_DATA_FILTER", None)
    for name in ("FilterError", "data_filter", "OutsideDestinationError", "AbsolutePathError"):
        monkeypatch.delattr(tarfile, name, raising=False)
    extractall, extract = tarfile.TarFile.extractall, tarfile.TarFile.extract

    # 3.11.2's signatures: no `filter` argument, everything extracted as the archive says.
    def old_extractall(self, path=".", members=None, *, numeric_owner=False):
        return extractall(self, path, members, numeric_owner=numeric_owner, filter="fully_trusted")

    def old_extract(self, member, path="", set_attrs=True, *, numeric_owner=False):
        return extract(self, member, path, set_attrs, numeric_owner=numeric_owner, filter="fully_trusted")

    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    monkeypatch.setattr(tarfile.TarFile, "extract", old_extract)


def test_unpack_on_a_python_without_the_data_filter(tiny_engine, tmp_path, monkeypatch):
    _without_data_filter(monkeypatch)
    tar = tmp_path / "x.tar"
    archive.pack(tiny_engine, tar)
    code, out, err = _llmc("unpack", tar, "-o", tmp_path / "engine", "--json")
    assert code == 0 and json.loads(out)["ok"], err
    work = tmp_path / "work"
    work.mkdir()
    evil = _crafted(tmp_path, tiny_engine, _two(_symlink("d", ".."), lambda tf: _add_file(tf, "d/escaped.txt")))
    code, _, err = _llmc("unpack", evil, "-o", work / "engine")
    assert code == 2 and "symlink" in err and "refusing" in err and "Traceback" not in err, err
    assert list(work.iterdir()) == [] and not (tmp_path / "escaped.txt").exists()


@pytest.mark.parametrize("data_filter", [True, False], ids=["with-filter", "without-filter"])
def test_unpack_writes_fixed_modes(tiny_engine, tmp_path, monkeypatch, data_filter):
    """A setuid, world-writable member owned by someone else lands as an ordinary 0644 file of the caller's."""
    if not data_filter:
        _without_data_filter(monkeypatch)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("tarfile's data filter exists from Python 3.11.4")
    tar, odd = tmp_path / "x.tar", tmp_path / "odd.tar"
    archive.pack(tiny_engine, tar)
    with tarfile.open(tar) as src, tarfile.open(odd, "w") as dst:
        for m in src.getmembers():
            if m.isfile():
                m.mode, m.uid, m.gid = 0o4777, 4242, 4242
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    code, _, err = _llmc("unpack", odd, "-o", tmp_path / "engine")
    assert code == 0, err
    files = [f for f in (tmp_path / "engine").rglob("*") if f.is_file()]
    assert files and all(f.stat().st_mode & 0o7777 == 0o644 for f in files)
    assert all(f.stat().st_uid == os.getuid() for f in files)


def test_unpack_verifies_the_result(tiny_engine, tmp_path):
    engine = _copy(tiny_engine, tmp_path / "e")
    tar = tmp_path / "x.tar"
    archive.pack(engine, tar)
    # Tamper inside the archive: rewrite it with one byte of the weights flipped.
    tampered = tmp_path / "t.tar"
    with tarfile.open(tar) as src, tarfile.open(tampered, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == "model.onnx.data":
                data = bytearray(data)
                data[10] ^= 1
                data = bytes(data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    code, _, err = _llmc("unpack", tampered, "-o", tmp_path / "out")
    assert code == 1 and "model.onnx.data" in err and "modified" in err
    assert not (tmp_path / "out").exists()


def test_unpack_accepts_a_plain_tar_of_the_directory(tiny_engine, tmp_path):
    # `tar -C engine -cf x.tar .` writes ./-prefixed names; those are fine.
    tar = tmp_path / "x.tar"
    with tarfile.open(tar, "w") as tf:
        for f in sorted(tiny_engine.iterdir()):
            if f.is_file() and not f.name.startswith("."):
                tf.add(f, arcname=f"./{f.name}")
    code, _, err = _llmc("unpack", tar, "-o", tmp_path / "out")
    assert code == 0, err
