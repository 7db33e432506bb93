"""`llmc serve` serves any llmc engine: a CUDA engine too (run here on torch's CPU ops, as CI can)."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
from filelock import FileLock

from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread


@pytest.fixture(scope="module")
def cuda_engine(tmp_path_factory, tiny_llama) -> Path:
    from llmc.compiler.build import BuildOptions, build

    base = tmp_path_factory.getbasetemp()  # shared by xdist workers, as tests/conftest.py does
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "llmc-shared"
    shared.mkdir(exist_ok=True)
    target = shared / "engine-tiny-cuda-fp32"
    with FileLock(str(shared / "engine-tiny-cuda-fp32.lock")):
        if not (target / ".done").exists():
            build(tiny_llama, target / "engine", BuildOptions(target="h100", engine="cuda", dtype="float32"))
            (target / ".done").touch()
    return target / "engine"


def test_cuda_engine_served_on_cpu_matches_engine_generate(cuda_engine):
    prompts = ["The for statement", "def f(x):"]
    ref = Engine.load(cuda_engine, device="cpu").generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    with serve_in_thread(Engine.load(cuda_engine, device="cpu"), ServeConfig(model_name="gpu")) as s:
        client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        out = client.completions.create(model="gpu", prompt=prompts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in out.choices] == [r.token_ids for r in ref]
        stream = client.completions.create(model="gpu", prompt=prompts[0], max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == ref[0].text
        assert s.state.engine.stats().kv_blocks_used == 0
