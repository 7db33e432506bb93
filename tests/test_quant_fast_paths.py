"""The fast forms of AWQ's and GPTQ's arithmetic against the plain forms they replaced (same decisions up to
float rounding), and the per-layer progress lines of a calibrated build."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli.main import cli
from llmc.quant import awq, gptq, int4
from llmc.quant import gram as gram_ops


def _layer(seed: int, n: int = 80, k: int = 320, outliers: int = 5):
    """Random weights and correlated activations with a few large channels (K not a multiple of 128)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1024, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)))
    x[:, rng.choice(k, outliers, replace=False)] *= 15
    return w, x.T @ x / len(x), np.abs(x).mean(0)


def _output_error_f64(w, w_hat, h) -> float:
    e = np.asarray(w, np.float64) - np.asarray(w_hat, np.float64)
    return float(np.einsum("nk,nk->", e @ h, e))


def test_output_error_matches_the_float64_form():
    w, h, _ = _layer(0)
    w_hat = int4.quantize_rtn(w, 64, False).dequantize()
    assert awq.output_error(w, w_hat, h) == pytest.approx(_output_error_f64(w, w_hat, h), rel=1e-5)


@pytest.mark.parametrize("symmetric", [False, True])
def test_scale_search_picks_the_alpha_of_the_float64_objective(symmetric):
    for seed in range(3):
        w, h, abs_mean = _layer(seed)
        got = awq.search_scales(w, abs_mean, h, 64, symmetric)
        x_mean = np.maximum(abs_mean, 1e-4)
        losses = []
        for alpha in np.arange(awq.ALPHA_GRID) / awq.ALPHA_GRID:
            s = x_mean**alpha
            s = s / np.sqrt(s.max() * s.min())
            w_hat = int4.quantize_rtn((w * s).astype(np.float32), 64, symmetric).dequantize() / s
            losses.append(_output_error_f64(w, w_hat, h))
        assert got.alpha == np.argmin(losses) / awq.ALPHA_GRID
        # The figures come from bfloat16 GEMMs (~3e-4 relative; see the next test).
        assert got.loss == pytest.approx(min(losses), rel=1e-3)
        assert got.loss_rtn == pytest.approx(losses[0], rel=1e-3)


@pytest.mark.parametrize("symmetric", [False, True])
def test_row_sampled_screen_keeps_the_best_alpha(monkeypatch, symmetric):
    """Screening on a sample of the rows (here 64 of 600) still lands on the float64 objective's best alpha, or
    on one whose objective is within bfloat16's error of it: the sampling error sizes the finalist set."""
    monkeypatch.setattr(awq, "SCREEN_ROWS", 64)
    for seed in range(3):
        w, h, abs_mean = _layer(10 + seed, n=600)
        got = awq.search_scales(w, abs_mean, h, 64, symmetric)
        x_mean = np.maximum(abs_mean, 1e-4)
        losses = {}
        for alpha in np.arange(awq.ALPHA_GRID) / awq.ALPHA_GRID:
            s = x_mean**alpha
            s = s / np.sqrt(s.max() * s.min())
            w_hat = int4.quantize_rtn((w * s).astype(np.float32), 64, symmetric).dequantize() / s
            losses[float(alpha)] = _output_error_f64(w, w_hat, h)
        assert losses[got.alpha] <= min(losses.values()) * (1 + 1e-3), (got.alpha, losses)
        assert got.loss == pytest.approx(losses[got.alpha], rel=1e-3)


def test_bf16_screen_error_is_far_below_the_screen_tolerance():
    import torch

    w, h, abs_mean = _layer(4, n=128, k=awq.UPPER_PANEL * 2 + 300, outliers=8)  # full panels and a ragged one
    upper = awq.bf16_upper(h)
    for alpha in (0.0, 0.3, 0.6, 0.95):
        s = np.maximum(abs_mean, 1e-4) ** alpha
        w_hat = int4.quantize_rtn((w * s).astype(np.float32), 128, False).dequantize() / s
        e = torch.from_numpy((w - w_hat).astype(np.float32))
        exact = _output_error_f64(w, w_hat, h)
        assert abs(awq.bf16_output_error(e, upper) / exact - 1) < 1e-3
        e64 = e.double().numpy()
        rows_exact = np.einsum("nk,nk->n", e64 @ h, e64)  # each row's figure, not only their sum
        np.testing.assert_allclose(awq._bf16_row_errors(e, upper).numpy(), rows_exact, rtol=1e-2)


@pytest.mark.parametrize("symmetric", [False, True])
def test_clip_search_equals_the_einsum_form(symmetric):
    """torch float32 codes and batched matmul against numpy's float64 einsum: the same choice everywhere but
    where two ratios tie within float32 rounding."""
    w, h, _ = _layer(5)
    gs = 64
    groups = int4.padded_groups(w, gs)
    n_groups = groups.shape[1]
    pad = n_groups * gs - w.shape[1]
    hp = np.pad(h, ((0, pad), (0, pad)))
    blocks = np.stack([hp[g * gs:(g + 1) * gs, g * gs:(g + 1) * gs] for g in range(n_groups)])
    best_loss = np.full(groups.shape[:2], np.inf)
    want = np.ones(groups.shape[:2], np.float32)
    for ratio in awq.CLIP_RATIOS:
        scale, zp = int4.group_params(groups, symmetric, ratio)
        q = int4.quantize_groups(groups, scale, zp).astype(np.float32)
        zero = np.float32(8.0) if zp is None else zp[..., None].astype(np.float32)
        e = ((q - zero) * scale[..., None] - groups).astype(np.float64)
        loss = np.einsum("ngi,gij,ngj->ng", e, blocks, e)
        better = loss < best_loss
        best_loss = np.where(better, loss, best_loss)
        want = np.where(better, np.float32(ratio), want)
    got = awq.search_clip(w, h, gs, symmetric)
    assert (got == want).mean() > 0.999, (got != want).sum()


def test_gptq_inverse_factor_equals_cholesky_of_the_inverse():
    _, h, _ = _layer(6)
    h[:, 7] = h[7, :] = 0.0
    u, dead = gptq.inverse_factor(h, damp=0.01)
    ref = h.copy()
    ref[dead, dead] = 1.0
    ref[np.diag_indices(len(ref))] += 0.01 * np.mean(np.diag(ref))
    inv = np.linalg.inv(np.linalg.cholesky(ref))
    want = np.linalg.cholesky(inv.T @ inv).T
    assert dead.tolist() == [i == 7 for i in range(len(h))]
    np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())  # float32, as GPTQ's own code


@pytest.mark.parametrize("symmetric", [False, True])
def test_gptq_of_stacked_linears_equals_each_alone(symmetric):
    w, h, _ = _layer(7, n=96)
    parts = [w[:32], w[32:40], w[40:]]
    stacked = gptq.quantize(w, h, 64, symmetric)
    start = 0
    for part in parts:
        alone = gptq.quantize(part, h, 64, symmetric)
        mine = int4.rows(stacked, start, start + len(part))
        start += len(part)
        # float32 GEMMs of another shape sum in another order: a code may cross a rounding boundary, rarely.
        assert np.mean(mine.q != alone.q) < 1e-3
        np.testing.assert_allclose(mine.scales, alone.scales, rtol=1e-5)
        if not symmetric:
            assert np.mean(mine.zero_points != alone.zero_points) < 1e-2


@pytest.fixture(scope="module")
def four_layer_llama(tmp_path_factory):
    from llmc.testing.checkpoints import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("four-layers") / "ckpt", seed=3, num_hidden_layers=4)


def test_calibration_progress_has_a_line_per_layer_with_an_eta_and_none_under_quiet(tmp_path, four_layer_llama,
                                                                                   monkeypatch):
    from llmc.quant import collect

    # Steps within a layer report once the layer has taken STEP_PROGRESS_S; this fixture's layers take
    # milliseconds, so 0 makes every step report.
    monkeypatch.setattr(collect, "STEP_PROGRESS_S", 0.0)
    args = ["build", str(four_layer_llama), "--cache-dir", str(tmp_path / "cache"), "--quant", "int4-gptq",
            "--calib-samples", "4", "--calib-seq-len", "32"]
    loud = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "a")])
    assert loud.exit_code == 0, loud.stderr
    lines = [ln for ln in loud.stderr.splitlines() if re.search(r"\] layer \d+/4 \(gptq\)", ln)]
    assert [re.search(r"layer (\d)/4", ln).group(1) for ln in lines] == ["1", "2", "3", "4"], loud.stderr
    assert all(re.search(r"s/layer, .* elapsed, ETA \d+(m\d\ds|s)", ln) for ln in lines), lines
    assert "ETA 0s" in lines[-1] and "[" + "#" * 20 + "]" in lines[-1]
    steps = [ln.strip() for ln in loud.stderr.splitlines() if "into the layer" in ln]
    assert [re.match(r"layer (\d)/4: (\S+) quantized, \d+s into the layer", ln).groups() for ln in steps] == [
        (str(i), g) for i in range(1, 5) for g in ("q_proj/k_proj/v_proj", "o_proj", "gate_proj/up_proj", "down_proj")
    ], steps
    assert loud.stdout.strip()  # the summary line
    quiet = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "b"), "--no-cache", "-q"])
    assert quiet.exit_code == 0, quiet.stderr
    assert quiet.stderr == "" and quiet.stdout == ""
    machine = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "c"), "--json"])  # a cache hit: fast
    assert machine.exit_code == 0 and machine.stderr == "", machine.stderr
    assert json.loads(machine.stdout)["accuracy"]  # the one object on stdout, and nothing on stderr


def _gptq_plain(w, h, group_size, symmetric, damp=0.01):
    """The column loop as it was (rank-1 updates over [N, 128] blocks, the inverse factor via inverse and
    a second Cholesky): the reference for the blocked, transposed form."""
    w = np.array(w, np.float64)
    n, k = w.shape
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    h_inv = np.linalg.inv(np.linalg.cholesky(h))
    u = np.linalg.cholesky(h_inv.T @ h_inv).T
    n_groups = -(-k // group_size)
    codes = np.zeros((n, n_groups * group_size), np.uint8)
    scales = np.zeros((n, n_groups), np.float32)
    for b0 in range(0, k, 128):
        b1 = min(b0 + 128, k)
        wb = w[:, b0:b1].copy()
        err = np.zeros_like(wb)
        ub = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                cols = wb[:, i : i + group_size]
                if cols.shape[1] < group_size:
                    cols = np.concatenate([cols, np.zeros((n, group_size - cols.shape[1]))], axis=1)
                scale, zp = int4.group_params(cols[:, None, :], symmetric)
                scale, zp = scale[:, 0], None if zp is None else zp[:, 0]
                scales[:, col // group_size] = scale
            q = int4.quantize_groups(wb[:, i : i + 1], scale, zp)[:, 0]
            codes[:, col] = q
            zero = np.float32(8.0) if zp is None else zp.astype(np.float32)
            e = (wb[:, i] - (q.astype(np.float32) - zero) * scale) / ub[i, i]
            wb[:, i:] -= np.outer(e, ub[i, i:])
            err[:, i] = e
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes[:, :k], scales


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_blocked_gptq_equals_the_plain_column_loop(symmetric, group):
    w, h, _ = _layer(8, n=64, k=320)
    got = gptq.quantize(w, h, group, symmetric)
    codes, scales = _gptq_plain(w, h, group, symmetric)
    # Summing the same updates in another order moves a weight across a rounding boundary at most rarely.
    assert np.mean(got.q[:, :320] != codes) < 1e-3
    np.testing.assert_allclose(got.scales, scales, rtol=1e-5)


@pytest.mark.parametrize("symmetric", [False, True])
def test_torch_rtn_gives_the_numpy_codes_scales_and_zero_points(symmetric):
    """quantize_rtn's torch path (large tensors) against group_params / quantize_groups in numpy: bit for bit,
    with a per-group clip and with ties, all-zero groups and exact half-step values."""
    rng = np.random.default_rng(21)
    groups = (rng.standard_normal((96, 5, 64)) * 0.05).astype(np.float32)
    groups[0, 0] = 0.0  # an all-zero group
    groups[1, 1, :2] = [0.08, -0.08]  # a tie for the largest magnitude
    groups[2, 2] = np.round(groups[2, 2] * 64) / 64  # values on a coarse grid: halves land exactly
    for clip in (1.0, rng.uniform(0.5, 1.0, groups.shape[:2]).astype(np.float32)):
        scale, zp = int4.group_params(groups, symmetric, clip)
        q = int4.quantize_groups(groups, scale, zp)
        t_scale, t_zp, t_q = int4._rtn_torch(groups, symmetric, clip)
        np.testing.assert_array_equal(t_scale, scale)
        np.testing.assert_array_equal(t_q, q)
        if symmetric:
            assert t_zp is None and zp is None
        else:
            np.testing.assert_array_equal(t_zp, zp)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [256, 320])
def test_torch_rtn_dequantized_equals_quantize_rtn_dequantize(symmetric, k):
    """The scale search's torch fake-quantization against quantize_rtn(...).dequantize(): bit for bit, with K not
    a multiple of the group size, an all-zero group and a row on a coarse grid (exact half steps)."""
    import torch

    rng = np.random.default_rng(22)
    w = (rng.standard_normal((48, k)) * 0.05).astype(np.float32)
    w[0, :128] = 0.0
    w[1] = np.round(w[1] * 64) / 64
    got = int4.torch_rtn_dequantized(torch.from_numpy(w), 128, symmetric).numpy()
    np.testing.assert_array_equal(got, int4.quantize_rtn(w, 128, symmetric).dequantize())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_upper_panel_gram_equals_the_full_gram(dtype, monkeypatch):
    """Calibration's Gram matrices summed by torch (as on a CPU without AVX-512 BF16) as upper-triangle panels
    (half the flops) and mirrored: the upper triangle equals the full X^T X GEMM's (bit for bit here; within
    float32 rounding in any case), the result is exactly symmetric, and partial sums over batches accumulate."""
    import torch

    from llmc.quant import calibration

    monkeypatch.setattr(gram_ops, "kernel_available", lambda: False)

    torch.manual_seed(3)
    k = gram_ops.GRAM_PANEL * 2 + 300  # two full panels and a ragged one
    batches = [torch.randn(200, k) * torch.rand(k) for _ in range(2)]
    gram = torch.zeros(k, k)
    full = torch.zeros(k, k)
    for x in batches:
        gram_ops.add_upper(gram, x, getattr(torch, dtype))
        xg = x.to(getattr(torch, dtype))
        full += (xg.T @ xg).float()
    collector = calibration._Collector({}, gram_dtype=getattr(torch, dtype))
    collector.inputs[("w",)] = calibration.InputStats(gram.numpy(), np.zeros(k))
    collector.finish()
    assert torch.equal(gram, gram.T)
    np.testing.assert_allclose(torch.triu(gram).numpy(), torch.triu(full).numpy(), rtol=1e-6, atol=1e-3)


@pytest.mark.skipif(not gram_ops.kernel_available(), reason="the CPU lacks AVX-512 BF16 (or the extension is unbuilt)")
@pytest.mark.parametrize("t,k", [(1, 5), (301, 300), (2051, 600)])  # odd token counts; K off every block size
def test_bf16_gram_kernel_equals_float64_sums(t, k):
    """The AVX-512 BF16 Gram kernel: exact bfloat16 products summed in float32, so its upper triangle is the
    float64 X^T X of the same bfloat16 values up to float32 rounding, added onto what the matrix held (several
    packed blocks of columns and of token pairs at 2051 x 600), and torch's float32 GEMM gives the same."""
    import torch

    torch.manual_seed(t + k)
    x = (torch.randn(t, k) * torch.rand(k) * 4).bfloat16()
    x[:, 1] = 0  # a dead channel
    start = torch.randn(k, k)
    gram = start.clone()
    gram_ops.add_upper(gram, x, torch.float32)
    x64 = x.double()
    want = start.double() + x64.T @ x64
    scale = float(want.abs().max())
    upper = torch.ones(k, k, dtype=torch.bool).triu()
    np.testing.assert_allclose(gram[upper].numpy(), want[upper].numpy(), rtol=1e-5, atol=1e-6 * scale)
    torch_path = start.clone()
    gram_ops.add_upper(torch_path, x.float(), torch.float32)  # float32 input: torch's float32 GEMM
    np.testing.assert_allclose(gram[upper].numpy(), torch_path[upper].numpy(), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.skipif(not gram_ops.kernel_available(), reason="the CPU lacks AVX-512 BF16 (or the extension is unbuilt)")
def test_bf16_gram_kernel_refuses_arrays_it_would_have_to_copy():
    """G is written in place: an array of another dtype or layout is an error, never a silently written copy."""
    import torch

    from llmc.quant import _gram

    pairs = gram_ops.token_pairs(torch.randn(4, 32).bfloat16()).numpy().view(np.uint32)
    for bad in (np.zeros((32, 32)), np.zeros((32, 32), np.float32)[:, ::-1], np.zeros((32, 32), np.float32).T[:16]):
        with pytest.raises(ValueError, match="G must be"):
            _gram.add_upper(bad, pairs, 1)
    with pytest.raises(ValueError, match="pairs must be"):
        _gram.add_upper(np.zeros((32, 32), np.float32), pairs.view(np.int32), 1)
    with pytest.raises(ValueError, match="Kp must be"):
        _gram.add_upper(np.zeros((64, 64), np.float32), pairs, 1)
