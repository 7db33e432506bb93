"""Greedy parity with transformers, the check most engine tests end with."""

from __future__ import annotations

from pathlib import Path

# Prompts of 4, 37 and 6 tokens (repeats in the last): the fixtures' usual three.
PROMPTS = ([5, 17, 33, 90], list(range(3, 40)), [7, 7, 7, 101, 250, 2])
# Prompts past a 16- or 32-token window or chunk (37, 38 and 57 tokens).
LONG_PROMPTS = (list(range(3, 40)), [7, 7, 7, 101, 250, 2] * 6 + [9, 11], [(i * 37) % 500 + 3 for i in range(57)])


def assert_greedy_matches_transformers(engine, checkpoint: str | Path, prompts=PROMPTS, max_tokens: int = 32) -> None:
    """``max_tokens`` greedy tokens after each prompt: ``engine`` (llmc.runtime.Engine, the prompts batched) against
    transformers running ``checkpoint`` in float32, one prompt at a time; EOS never stops either side."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.runtime import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outs = engine.generate([list(p) for p in prompts], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (list(prompt), out.token_ids, ref)
