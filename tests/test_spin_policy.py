"""ONNX Runtime thread spinning: the setting, the load measurement behind ``auto``, and the session it makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmc.errors import LlmcError
from llmc.runtime.workers.ort import spin_policy
from llmc.runtime.workers.ort.session import OrtSession


@pytest.mark.parametrize("setting,spin", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_explicit_setting_wins(setting, spin):
    assert spin_policy.decide(2, setting, busy=0.0)[0] is spin
    assert spin_policy.decide(2, setting, busy=float(os.cpu_count()))[0] is spin


def test_auto_spins_only_on_free_cores():
    cores = os.cpu_count() or 1
    assert spin_policy.decide(cores, "auto", busy=0.1)[0] is True
    spin, why = spin_policy.decide(cores, "auto", busy=1.0)
    assert spin is False and "1.00 cores busy" in why
    assert spin_policy.decide(1, "auto", busy=cores - 1.0)[0] is True  # one thread, one free core


def test_bad_setting_names_the_variable(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="LLMC_ORT_SPIN='sometimes'"):
        spin_policy.decide(2, "sometimes")
    monkeypatch.setenv("LLMC_ORT_SPIN", "sometimes")
    with pytest.raises(LlmcError, match="LLMC_ORT_SPIN"):
        OrtSession(b"not a model", num_threads=1)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_busy_cores_sees_another_process_and_not_this_one():
    """A busy child process counts; this process's own work during the sample does not."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = spin_policy.busy_cores(0.3)
    finally:
        child.kill()
        child.wait()
    assert busy is not None and 0.6 <= busy <= os.cpu_count() + 0.01


@pytest.mark.parametrize("setting", ["0", "1"])
def test_session_applies_the_choice(tiny_engine, monkeypatch, setting):
    import json

    monkeypatch.setenv("LLMC_ORT_SPIN", setting)
    model = tiny_engine / json.loads((tiny_engine / "manifest.json").read_text())["engine"]["model_file"]
    session = OrtSession(model, num_threads=2)
    assert session.spinning is (setting == "1")
    entry = session._session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    assert entry == setting
