"""Same engines, byte for byte: a fixed set of builds compared file by file with sha256s recorded before the
build's restructuring (issue 47: the build as stages behind a backend protocol must emit exactly what the
inline build did).

The recorded hashes are tied to the toolchain that made them (torch, transformers, onnx, ... change the
traced graph, and transformers' version is written into the fixture checkpoints' config.json). Where the
installed toolchain differs from the recorded one, the test is skipped naming the difference; record again with
``python tests/test_same_engines.py --record`` from the commit whose engines are the reference.

``build_info.json`` (timings, host, time) is not sealed and not compared; every other file is.

``default-cpu-int4-awq`` was recorded from ae52406, before issue 50's build-speed changes (grouped scoring windows,
bfloat16 range calibration, malloc_trim), which must leave AWQ's engines unchanged; the FP8 cases from 440b6bd,
whose range calibration runs in bfloat16.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "tests" / "data" / "same_engines.json"
DEFAULT_MODEL = REPO / "assets" / "default-model"

# name -> (checkpoint, BuildOptions keyword arguments); quant recipes by name
CASES: dict[str, tuple[str, dict]] = {
    "default-cpu-fp32": ("default", {}),
    "default-cpu-int4": ("default", {"quant": "int4"}),
    "default-cpu-fp8": ("default", {"quant": "fp8"}),
    "default-cpu-int4-awq": ("default", {"quant": "int4-awq"}),
    "tiny-h100-bf16": ("tiny", {"target": "h100"}),
    "tiny-h100-fp8": ("tiny", {"target": "h100", "quant": "fp8"}),
    "tiny-cpu-lora": ("tiny", {"lora_slots": 2, "max_lora_rank": 8}),
    "hybrid-lfm2-cpu": ("lfm2", {}),
}


def _checkpoint(kind: str, root: Path) -> Path:
    if kind == "default":
        return DEFAULT_MODEL
    out = root / f"ckpt-{kind}"
    if not (out / ".done").exists():
        if kind == "tiny":
            from llmc.testing.checkpoints import write_tiny_llama

            write_tiny_llama(out, seed=0)
        else:
            from llmc.testing.hybrids import write_hybrid

            write_hybrid(kind, out, seed=0)
        (out / ".done").touch()
    return out


def _build(name: str, root: Path) -> dict[str, str]:
    """Build case ``name`` under ``root``; returns {relative path: sha256} of every artifact file but build_info."""
    from llmc.compiler.build import BuildOptions, build
    from llmc.quant.recipe import QuantRecipe

    kind, kwargs = CASES[name]
    kwargs = dict(kwargs)
    if "quant" in kwargs:
        kwargs["quant"] = QuantRecipe(quant=kwargs["quant"])
    out = root / name
    # A fresh build cache each: report.json records whether the accuracy report's reference scores came from it.
    os.environ["LLMC_CACHE_DIR"] = str(root / f"cache-{name}")
    shutil.rmtree(root / f"cache-{name}", ignore_errors=True)
    build(_checkpoint(kind, root), out, BuildOptions(force=True, **kwargs))
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "build_info.json"}


def _toolchain() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from llmc.compiler.artifact import toolchain_versions

    out = dict(toolchain_versions())
    for pkg in ("triton",):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def _root(tmp_path_factory) -> Path:
    """This run's directory, shared by its xdist workers (as conftest's shared fixtures)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "llmc-same-engines"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def recorded() -> dict:
    data = json.loads(RECORD.read_text())
    here = _toolchain()
    diff = {k: (v, here.get(k)) for k, v in data["toolchain"].items() if here.get(k) != v}
    if diff:
        pytest.skip(f"toolchain differs from the one the hashes were recorded with (recorded, here): {diff}")
    return data


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_files_are_byte_identical(name, recorded, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_SELF_CHECK", "0")
    monkeypatch.setenv("LLMC_CACHE_DIR", os.environ.get("LLMC_CACHE_DIR", ""))  # restored after _build sets it
    root = _root(tmp_path_factory)
    from filelock import FileLock

    with FileLock(str(root / f"{name}.lock")):
        got = _build(name, root)
    want = recorded["cases"][name]
    assert sorted(got) == sorted(want), f"{name}: files differ: {sorted(set(got) ^ set(want))}"
    changed = [f for f in want if got[f] != want[f]]
    assert not changed, f"{name}: these files changed: {changed}"


@pytest.mark.slow
@pytest.mark.parametrize("name,files", [("default-cpu-fp32", "model.onnx"), ("tiny-h100-bf16", "kernels/*.cubin")])
def test_engines_hold_no_install_paths(name, files, recorded, tmp_path_factory):
    """The engine is the same wherever llmc is installed: neither the graph (torch.onnx's stack traces) nor the
    kernels (Triton's line tables) name a source path of llmc or its libraries."""
    root = _root(tmp_path_factory)
    from filelock import FileLock

    with FileLock(str(root / f"{name}.lock")):
        if not (root / name / "manifest.json").exists():
            _build(name, root)
        blobs = {p.name: p.read_bytes() for p in sorted((root / name).glob(files))}
    assert blobs
    import transformers
    import triton

    import llmc

    for package in (llmc, transformers, triton):
        where = str(Path(package.__file__).parent).encode()
        for file, blob in blobs.items():
            assert where not in blob, f"{name}/{file} names {where!r}"
    assert not any(b"pkg.torch.onnx.stack_trace" in blob for blob in blobs.values())


def _record() -> None:
    import tempfile

    os.environ["LLMC_SELF_CHECK"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        cases = {name: _build(name, Path(tmp)) for name in CASES}
    import subprocess

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"commit": commit.strip(), "toolchain": _toolchain(), "cases": cases},
                                 indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(cases)} builds in {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_same_engines.py --record")
    _record()
