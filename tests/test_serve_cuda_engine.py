"""`llmc serve` serves any llmc engine: a CUDA engine too (run here on torch's CPU ops, as CI can)."""

from __future__ import annotations

import openai

from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread


def test_cuda_engine_served_on_cpu_matches_engine_generate(tiny_cuda_engine):
    """The session's H100 engine in float32 (tests/conftest.py), served on the CPU."""
    prompts = ["The for statement", "def f(x):"]
    ref = Engine.load(tiny_cuda_engine, device="cpu").generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    with serve_in_thread(Engine.load(tiny_cuda_engine, device="cpu"), ServeConfig(model_name="gpu")) as s:
        client = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0)
        out = client.completions.create(model="gpu", prompt=prompts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [c.model_extra["token_ids"] for c in out.choices] == [r.token_ids for r in ref]
        stream = client.completions.create(model="gpu", prompt=prompts[0], max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == ref[0].text
        assert s.state.engine.stats().kv_blocks_used == 0
