"""AWQ, GPTQ and calibration data handling, on synthetic layers with known structure (no model build)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.quant import awq, calibration, gptq, int4


def _layer(seed: int, n: int = 96, k: int = 256, outliers: int = 6):
    """Random weights and activations with correlated channels and a few large-magnitude channels."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((2048, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)))
    x[:, rng.choice(k, outliers, replace=False)] *= 15
    return w, x.T @ x / len(x), np.abs(x).mean(0)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_beats_rtn_on_the_output_error(symmetric, group):
    w, h, _ = _layer(1)
    rtn = int4.quantize_rtn(w, group, symmetric)
    q = gptq.quantize(w, h, group, symmetric)
    assert q.q.shape == rtn.q.shape and q.scales.shape == rtn.scales.shape
    assert (q.zero_points is None) == symmetric
    e_rtn = awq.output_error(w, rtn.dequantize(), h)
    e_gptq = awq.output_error(w, q.dequantize(), h)
    assert e_gptq < 0.8 * e_rtn


def test_gptq_with_an_identity_hessian_is_round_to_nearest():
    # No correlations: there is nothing to compensate, so every column rounds exactly as RTN would.
    w, _, _ = _layer(2, k=192)
    for symmetric in (False, True):
        q = gptq.quantize(w, np.eye(192), 64, symmetric, damp=0.0)
        rtn = int4.quantize_rtn(w, 64, symmetric)
        np.testing.assert_array_equal(q.q, rtn.q)
        np.testing.assert_array_equal(q.scales, rtn.scales)


def test_gptq_zeroes_dead_channels_and_is_deterministic():
    w, h, _ = _layer(3)
    h[:, 5] = h[5, :] = 0.0
    a = gptq.quantize(w, h, 64, False)
    b = gptq.quantize(w, h, 64, False)
    assert a.dequantize()[:, 5] == pytest.approx(0.0, abs=1e-7)
    np.testing.assert_array_equal(a.matmulnbits_b(), b.matmulnbits_b())
    np.testing.assert_array_equal(a.scales, b.scales)


@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_scales_and_clipping_beat_rtn(symmetric):
    w, h, abs_mean = _layer(4)
    search = awq.search_scales(w, abs_mean, h, 128, symmetric)
    rtn_error = awq.output_error(w, int4.quantize_rtn(w, 128, symmetric).dequantize(), h)
    assert search.loss_rtn == pytest.approx(rtn_error, rel=1e-3)  # alpha = 0 is plain RTN (bfloat16 GEMMs)
    assert search.alpha > 0 and search.loss < 0.9 * search.loss_rtn
    # The big channels get the big scales.
    big = np.argsort(abs_mean)[-6:]
    assert np.all(search.scales[big] > np.median(search.scales))
    clipped = awq.quantize(w, search.scales, h, 128, symmetric).dequantize() / search.scales
    assert awq.output_error(w, clipped, h) <= search.loss * (1 + 1e-9)


def test_awq_clip_search_returns_a_ratio_per_row_and_group():
    w, h, _ = _layer(5, n=8, k=128)
    ratios = awq.search_clip(w, h, 64, False)
    assert ratios.shape == (8, 2)
    assert set(np.unique(ratios)) <= {np.float32(r) for r in awq.CLIP_RATIOS}


# -- calibration data ---------------------------------------------------------------------------------

def test_sample_sequences_are_deterministic_windows():
    docs = [list(range(100, 160)), list(range(200, 290))]
    a = calibration.sample_sequences(docs, 5, 16, seed=7, separator=0)
    b = calibration.sample_sequences(docs, 5, 16, seed=7, separator=0)
    c = calibration.sample_sequences(docs, 5, 16, seed=8, separator=0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    stream = np.asarray(docs[0] + [0] + docs[1] + [0])
    for row in a:  # every sample is a contiguous window of the stream
        starts = np.flatnonzero(stream == row[0])
        assert any(np.array_equal(stream[s : s + 16], row) for s in starts)
    with pytest.raises(LlmcError, match="fewer than --calib-seq-len"):
        calibration.sample_sequences([[1, 2, 3]], 2, 16, seed=0)


def test_load_texts_plain_jsonl_and_errors(tmp_path):
    plain = tmp_path / "calib.txt"
    plain.write_text("some text\nover two lines\n")
    assert calibration.load_texts(plain) == ["some text\nover two lines\n"]
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 3}) + "\n")
    assert calibration.load_texts(jsonl) == ["first", "second"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(LlmcError, match=r"bad.jsonl:2: needs a \"text\" field"):
        calibration.load_texts(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(LlmcError, match="broken.jsonl:1: not valid JSON"):
        calibration.load_texts(broken)
    with pytest.raises(LlmcError, match="no such file"):
        calibration.load_texts(tmp_path / "missing.txt")
    assert len(calibration.load_texts(None)) > 10  # the built-in pydoc training split


def test_calibration_attention_masks_are_always_explicit():
    """The mask function llmc registers for calibration returns the causal mask itself, never None for SDPA's
    is_causal: families that attend inline (bloom, mpt) read that mask, and with None bloom attended to future
    tokens while calibrating and mpt failed (.to(bool) on None)."""
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from llmc.quant import calibration

    calibration._register_attention()
    mask = ALL_MASK_ATTENTION_FUNCTIONS[calibration.CALIB_ATTENTION](
        batch_size=1, q_length=5, kv_length=5, allow_is_causal_skip=True, device="cpu")
    assert mask is not None
    assert torch.equal(mask.reshape(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())
