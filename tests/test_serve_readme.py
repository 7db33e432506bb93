"""The README's serving example works as printed: `llmc serve`, its curl call, its openai call and its tool call
(port swapped)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _serving_blocks() -> tuple[str, str, str, str]:
    section = README.read_text().split("\n## Serving\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    serve = next(line for lang, b in blocks if lang == "bash" for line in b.splitlines()
                 if line.startswith("llmc serve "))
    curl = next(b for lang, b in blocks if lang == "bash" and b.startswith("curl "))
    python, tools = [b for lang, b in blocks if lang == "python"][:2]
    return serve, curl, python, tools


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_serving_example_runs_as_printed(default_engine, tmp_path):
    serve, curl, python, tools = _serving_blocks()
    args = serve.split("#")[0].split()
    assert args[:3] == ["llmc", "serve", "engines/m"] and "8000" in args
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "m").symlink_to(default_engine)  # the README's path; the model is named "m"
    args[args.index("8000")] = "0"
    proc = subprocess.Popen([sys.executable, "-m", "llmc.cli.main", *args[1:], "--threads", "1"], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"'m' on http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
        assert m, "llmc serve did not say where it listens"
        port = m.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)
        out = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"localhost:{port}")],
                             capture_output=True, text=True, timeout=60)
        body = json.loads(out.stdout)
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["text"].strip()
        py = subprocess.run([sys.executable, "-c", python.replace("localhost:8000", f"localhost:{port}")],
                            capture_output=True, text=True, timeout=60)
        assert py.returncode == 0, py.stderr
        assert len(py.stdout.strip()) > 20
        py = subprocess.run([sys.executable, "-c", tools.replace("localhost:8000", f"localhost:{port}")],
                            capture_output=True, text=True, timeout=60)  # the tool call example
        assert py.returncode == 0, py.stderr
        assert py.stdout.startswith("tool_calls get_weather {'city': "), py.stdout
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
