"""Families outside the tested list, built as a new user would (tiny random checkpoints from transformers' own
config classes): each either builds an engine that matches transformers' greedy tokens, or is refused (exit 3,
one line, nothing left behind), never an internal error and never a silently wrong engine.

The architecture self-check is off here: for a CPU build its twin goes through the same pipeline as this
fixture, a random config of the same size, so its verdict is the comparison this test makes itself (8 of a
family's ~16 CPU seconds). tests/test_selfcheck.py tests the check; scripts/family_sweep.py runs every family
with it on (docs/family_sweep.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmc.testing.greedy import assert_greedy_matches_transformers
from llmc.testing.tried_families import TRIED_FAMILIES as CASES
from llmc.testing.tried_families import write_tried_family

# Families whose own test file builds this same fixture with the self-check on and holds it to transformers
# (tests/test_alibi_models.py, tests/test_llama4_text.py): a second build here would check nothing new.
CHECKED_ELSEWHERE = {"bloom", "llama4_text"}


@pytest.mark.parametrize("model_type", sorted(set(CASES) - CHECKED_ELSEWHERE))
def test_family_builds_correctly_or_is_refused(model_type, tmp_path):
    overrides, mechanism, expected = CASES[model_type]
    ckpt = write_tried_family(model_type, tmp_path / "ckpt")
    env = dict(os.environ, LLMC_SELF_CHECK="0", LLMC_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(ckpt), "-o", str(tmp_path / "e"),
                           "-q"], capture_output=True, text=True, env=env)
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr[-3000:]
    if expected == "builds":
        assert proc.returncode == 0, f"{model_type} ({mechanism}): {last}"
        from llmc.runtime import Engine

        assert_greedy_matches_transformers(Engine.load(tmp_path / "e"), ckpt)
    else:
        assert proc.returncode == 3 and expected in last and model_type in last, f"{model_type}: {last}"
        assert last.startswith("error: ") and str(tmp_path / "cache") not in last
        assert not (tmp_path / "e").exists()

