"""`import llmc.runtime` (and serving an engine) must work where torch and transformers cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx', 'onnxscript', 'onnx_ir', 'safetensors'):
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True)


def test_blocker_really_blocks():
    assert _run("import torch").returncode != 0


def test_import_runtime_without_torch():
    proc = _run("import llmc.runtime; from llmc.runtime import Engine, SamplingParams; print('ok')")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_generate_without_torch(tiny_engine):
    proc = _run(
        "from llmc.runtime import Engine, SamplingParams\n"
        f"e = Engine.load({str(tiny_engine)!r})\n"
        "o = e.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True))[0]\n"
        "import json, sys; print(json.dumps(o.token_ids)); assert 'torch' not in sys.modules\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 5
