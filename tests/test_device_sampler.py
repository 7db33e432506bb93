"""The CUDA engine's sampler (torch, where the logits are) against the numpy sampler it replaces.

Same logits, same parameters, same generator state: the same token ids and logprobs, row by row, for
every combination of greedy / temperature / top_k / top_p / min_p / penalties / logprobs, whatever
a row is batched with. Runs on torch's CPU ops here; on a GPU the same code runs on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.runtime.sampling.sampler import SampleRow, SamplingParams, sample, token_logprobs
from llmc.runtime.workers.cuda.sampler import sample_rows


def _random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.4, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 7, 60, vocab + 3])),
        top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])), min_p=float(rng.choice([0.0, 0.02, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])), presence_penalty=float(rng.choice([0.0, 0.6])),
        frequency_penalty=float(rng.choice([0.0, -0.4, 0.7])), logprobs=rng.choice([None, 0, 1, 5]))


def _case(rng: np.random.Generator, n: int, vocab: int):
    """``n`` rows of fresh logits with random parameters and histories, and what the numpy sampler picks."""
    logits = (rng.standard_normal((n, vocab)) * rng.uniform(0.5, 4.0)).astype(np.float32)
    rows, want = [], []
    for i in range(n):
        p = _random_params(rng, vocab)
        prompt_len = int(rng.integers(1, 12))
        context = rng.integers(0, vocab, prompt_len + int(rng.integers(0, 20))).tolist()
        seed = int(rng.integers(1 << 62))
        history = context if p.uses_history else ()
        token = sample(logits[i], p, np.random.default_rng(seed), history, prompt_len)
        want.append((token, token_logprobs(logits[i], token, p.logprobs) if p.logprobs is not None else None))
        # the uniform numpy's Generator.choice draws: the same generator state, one random()
        uniform = None if p.greedy else float(np.random.default_rng(seed).random())
        rows.append(SampleRow(i, p, history, prompt_len, uniform))
    return logits, rows, want


def _assert_same(got_tokens, got_lps, want) -> None:
    for (token, lp), g, glp in zip(want, got_tokens, got_lps, strict=True):
        assert g == token
        if lp is None:
            assert glp is None
        else:
            assert set(glp) == set(lp)
            assert all(abs(glp[k] - lp[k]) < 1e-9 for k in lp)


@pytest.mark.parametrize("vocab", [97, 4096])
def test_device_sampler_picks_the_numpy_samplers_tokens(vocab):
    rng = np.random.default_rng()
    checked = sampled = 0
    for _ in range(60):
        logits, rows, want = _case(rng, int(rng.integers(1, 12)), vocab)
        tokens, lps = sample_rows(torch.from_numpy(logits), rows)
        _assert_same(tokens, lps, want)
        checked += len(rows)
        sampled += sum(not r.params.greedy for r in rows)
    assert sampled > checked // 2  # most rows really sampled


def test_a_rows_token_does_not_depend_on_its_batch():
    rng = np.random.default_rng()
    logits, rows, want = _case(rng, 16, 500)
    x = torch.from_numpy(logits)
    alone = [sample_rows(x, [r]) for r in rows]
    together = sample_rows(x, rows[::-1])  # another order, one batch
    assert [a[0][0] for a in alone] == together[0][::-1] == [w[0] for w in want]


def test_rows_are_read_at_their_index_and_bf16_logits_are_widened_first():
    rng = np.random.default_rng()
    logits = torch.from_numpy(rng.standard_normal((6, 300)).astype(np.float32)).bfloat16()
    widened = logits.float().numpy()
    p = SamplingParams(temperature=0.9, top_p=0.8, logprobs=2)
    seeds = rng.integers(1 << 62, size=3)
    at = list(zip((5, 0, 3), seeds, strict=True))
    rows = [SampleRow(i, p, (), 0, float(np.random.default_rng(s).random())) for i, s in at]
    tokens, lps = sample_rows(logits, rows)
    for (i, s), t, lp in zip(at, tokens, lps, strict=True):
        assert t == sample(widened[i], p, np.random.default_rng(s))
        want = token_logprobs(widened[i], t, 2)
        # bf16 logits tie often, and which of two tied ids numpy's argpartition keeps is arbitrary: compare values
        assert lp[t] == pytest.approx(want[t], abs=1e-12)
        assert sorted(lp.values())[-2:] == pytest.approx(sorted(want.values())[-2:], abs=1e-12)


def test_sampled_frequencies_follow_the_distribution():
    """Not only the same as numpy: right. 20000 draws from a known 6-token distribution; the chi-square
    statistic (5 degrees of freedom) must stay under 30, which a correct sampler exceeds with p ~ 1e-5."""
    rng = np.random.default_rng()
    probs = rng.dirichlet(np.ones(6))
    logits = torch.from_numpy(np.log(probs).astype(np.float32))[None].repeat(20000, 1)
    p = SamplingParams(temperature=1.0)
    rows = [SampleRow(i, p, (), 0, float(u)) for i, u in enumerate(rng.random(20000))]
    tokens, _ = sample_rows(logits, rows)
    counts = np.bincount(tokens, minlength=6)
    expected = probs * 20000
    assert float(((counts - expected) ** 2 / expected).sum()) < 30.0


def test_a_sampled_row_without_a_uniform_is_refused():
    with pytest.raises(ValueError, match="need a uniform"):
        sample_rows(torch.zeros(1, 10).normal_(), [SampleRow(0, SamplingParams(temperature=1.0))])
