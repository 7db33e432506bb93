"""Families outside the tested list, built as a new user would (tiny random checkpoints from transformers' own
config classes): each either builds an engine that matches transformers' greedy tokens, or is refused (exit 3,
one line, nothing left behind), never an internal error and never a silently wrong engine.

The architecture self-check is off here: for a CPU build its twin goes through the same pipeline as this
fixture, a random config of the same size, so its verdict is the comparison this test makes itself (8 of a
family's ~16 CPU seconds). tests/test_selfcheck.py tests the check; scripts/family_sweep.py runs every family
with it on (docs/family_sweep.md).

``llmc build`` runs through the CLI's own entry (click's runner, as tests/test_config_fuzz.py and the sweep's
families do): its exit codes and one-line errors are the command's, and each family saves a fresh process's start
of torch, transformers and torch.export (about 5 of a family's seconds). tests/test_bad_input.py runs the installed
console script."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
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
    env = {"LLMC_SELF_CHECK": "0", "LLMC_CACHE_DIR": str(tmp_path / "cache")}
    result = CliRunner().invoke(cli, ["build", str(ckpt), "-o", str(tmp_path / "e"), "-q"], env=env)
    stderr = result.stderr
    last = (stderr.strip().splitlines() or [""])[-1]
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    # an exception that escaped the command (SystemExit is its exit code) would be a traceback in a process
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    if expected == "builds":
        assert result.exit_code == 0, f"{model_type} ({mechanism}): {last}"
        from llmc.runtime import Engine

        assert_greedy_matches_transformers(Engine.load(tmp_path / "e"), ckpt)
    else:
        assert result.exit_code == 3 and expected in last and model_type in last, f"{model_type}: {last}"
        assert last.startswith("error: ") and str(tmp_path / "cache") not in last
        assert not (tmp_path / "e").exists()

