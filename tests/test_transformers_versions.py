"""The transformers range llmc declares is the one it tests (issue 48): builds refuse any other version in one line
before any work; the manifest and the cache key carry the version; the families whose lowering leans on
transformers' internals match it at the lowest declared version (and, through the rest of the suite, at the
resolved one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.compiler import versions
from llmc.errors import LlmcError

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_declares_the_range_builds_accept():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = [d.removeprefix("transformers") for d in deps if d.startswith("transformers")]
    assert declared == [versions.SUPPORTED_TRANSFORMERS]
    versions.check_transformers()  # the installed one is inside it


@pytest.mark.parametrize("installed", ["5.24.0", "5.26.0", "6.0.0", "not-a-version"])
def test_a_transformers_outside_the_range_is_refused_in_one_line_before_any_work(monkeypatch, tmp_path, installed):
    monkeypatch.setattr(versions, "installed_transformers", lambda: installed)
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    out = tmp_path / "out"
    # the checkpoint does not exist: the version is refused before it is looked at
    result = CliRunner().invoke(cli, ["build", str(tmp_path / "nope"), "-o", str(out)])
    assert result.exit_code == 2, result.output
    err = result.stderr if hasattr(result, "stderr") else result.output
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"transformers {installed} is installed" in lines[0]
    assert f"transformers{versions.SUPPORTED_TRANSFORMERS}" in lines[0]
    assert not out.exists()


def test_the_override_builds_with_a_warning_and_absent_transformers_is_named(monkeypatch, caplog):
    monkeypatch.setattr(versions, "installed_transformers", lambda: "5.24.0")
    monkeypatch.setenv(versions.OVERRIDE_ENV, "1")
    versions.check_transformers()
    assert "5.24.0" in caplog.text and "building anyway" in caplog.text
    with pytest.raises(LlmcError, match="transformers is not installed") as exc:
        monkeypatch.setattr(versions, "installed_transformers", lambda: None)
        versions.check_transformers()
    assert exc.value.exit_code == 2


def test_manifest_and_cache_key_carry_the_transformers_version(tiny_engine, tmp_path, monkeypatch):
    import dataclasses

    from llmc.compiler import artifact
    from llmc.compiler.build import BuildOptions
    from llmc.compiler.build.driver import cache_key_inputs
    from llmc.compiler.build.plan import make_plan

    installed = versions.installed_transformers()
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    assert manifest["toolchain"]["transformers"] == installed
    plan = make_plan(tmp_path / "out", BuildOptions())
    inputs = cache_key_inputs("0" * 64, plan)
    assert inputs.toolchain["transformers"] == installed
    other = dict(artifact.toolchain_versions(), transformers="5.25.1")
    monkeypatch.setattr(artifact, "toolchain_versions", lambda: other)
    moved = cache_key_inputs("0" * 64, plan)
    assert moved.toolchain["transformers"] == "5.25.1" and moved.key() != inputs.key()
    assert dataclasses.replace(moved, toolchain=inputs.toolchain).key() == inputs.key()


def _lowest_on_path(version: str) -> Path:
    """A --target directory holding transformers ``version`` (installed once per machine, then reused)."""
    target = Path(os.environ.get("LLMC_TEST_CACHE", Path.home() / ".cache" / "llmc-test")) / f"transformers-{version}"
    if not (target / ".done").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"transformers=={version}"], check=True)
        (target / ".done").touch()
    return target


def test_hybrids_match_transformers_at_the_lowest_declared_version(tmp_path, monkeypatch):
    """Qwen3.5 and Qwen3-Next (three Gated DeltaNet layers then full attention), Falcon-H1 (its config class's own
    Mamba2 set-up) and LFM2, built with the self-check on, generate transformers' greedy tokens under the lowest
    transformers the range admits: in this process where that is the one installed, else in a subprocess with it
    first on the path (pip-installed once into a cached directory)."""
    from packaging.version import Version

    from llmc.testing import hybrid_match

    lowest = versions.lowest_supported()
    if Version(versions.installed_transformers()) == Version(lowest):
        # A cache of its own: the session's may hold these twins' verdicts from other tests ("cached", not run).
        monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
        families = hybrid_match.check_all(tmp_path)
    else:
        path = os.pathsep.join(p for p in (str(_lowest_on_path(lowest)), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, LLMC_CACHE_DIR=str(tmp_path / "cache"))
        proc = subprocess.run([sys.executable, "-m", "llmc.testing.hybrid_match", str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        assert Version(answer["transformers"]) == Version(lowest)
        families = answer["families"]
    assert set(families) == {"qwen3_5_text", "qwen3_next", "falcon_h1", "lfm2"}
    for model_type, outcome in families.items():
        assert outcome["outcome"] == "match", (model_type, outcome)
        assert outcome["self_check"] == "passed", (model_type, outcome)
