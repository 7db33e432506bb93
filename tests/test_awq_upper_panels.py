"""The AWQ/GPTQ searches' bfloat16 upper form of ``H = gram / rows``, made a panel of rows at a time
(``bf16_upper_from_gram``, issue 50: a 1B model's calibration peak held the float32 ``H`` and its doubled triangle
beside the Gram, 536 MB at K = 8192): the same bits as the whole-matrix form, for every K and panel edge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmc.quant import awq
from llmc.quant.calibration import InputStats


@pytest.mark.parametrize("k,panel", [(48, 1024), (1000, 256), (2048, 1024), (1500, 512)])
def test_panels_give_the_whole_matrix_bits(k, panel):
    rng = np.random.default_rng()
    x = (rng.standard_normal((300, k)) * rng.uniform(0.1, 5, k)).astype(np.float32)
    rows = int(rng.integers(200, 400))
    stats = InputStats(gram=(x.T @ x).astype(np.float32), abs_sum=np.abs(x).sum(0), rows=rows)
    whole = awq.bf16_upper(torch.from_numpy(stats.hessian_as(np.float32)))
    panels = awq.bf16_upper_from_gram(stats.gram, rows, panel=panel)
    assert panels.dtype == torch.bfloat16 and panels.shape == (k, k)
    assert torch.equal(whole.view(torch.int16), panels.view(torch.int16))
