"""Unit tests of the runtime's pieces: block manager, sampler, artifact verification."""

from __future__ import annotations

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.sampling.sampler import SamplingParams, sample


def test_block_manager_allocates_and_frees():
    bm = BlockManager(8)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8)) and bm.num_free == 0
    with pytest.raises(MemoryError):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free == 3
    assert sorted(bm.allocate(3)) == sorted(a)


def test_greedy_is_argmax():
    rng = np.random.default_rng()
    logits = rng.standard_normal(1000).astype(np.float32)
    assert sample(logits, SamplingParams(), rng) == int(np.argmax(logits))


def test_top_k_one_is_greedy_even_when_hot():
    rng = np.random.default_rng()
    logits = rng.standard_normal(100).astype(np.float32)
    params = SamplingParams(temperature=5.0, top_k=1, seed=0)
    assert {sample(logits, params, rng) for _ in range(20)} == {int(np.argmax(logits))}


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), rng) for _ in range(300)}
    assert draws == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(1)
    draws = [sample(np.log(probs).astype(np.float32), SamplingParams(temperature=1.0), rng) for _ in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}])
def test_bad_sampling_params(kwargs):
    with pytest.raises(LlmcError):
        SamplingParams(**kwargs)
