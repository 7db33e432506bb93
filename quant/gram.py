"""Gram matrices ``XᵀX`` of calibration activations, summed into float32, on and above the diagonal.

bfloat16 inputs (activations of a calibration forward under bfloat16 autocast, or any rounded to bfloat16 for
speed) go through ``llmc.quant._gram``'s AVX-512 BF16 kernel when the CPU has it: exact products summed in
float32, the float32 GEMM's result on those values up to the order of its sums, at 3.4x its rate here and 1.2x
torch's bfloat16 GEMM, which rounds its output to bfloat16. float32 inputs, or a CPU without AVX-512 BF16, take
torch's GEMMs.
"""

from __future__ import annotations

import functools

import numpy as np

# Gram matrices are summed as row panels of their upper triangle: X^T X is symmetric, so half its GEMM flops (less
# a panel's diagonal block) give all of it. The upper entries equal the full GEMM's (bit for bit in the runs here,
# tested to 1e-6); the lower ones become their mirror (mirror_upper), which is all GPTQ's Cholesky (of the flipped
# matrix: H's upper triangle) ever read. 38 % off a 1B down projection's float32 Gram here.
GRAM_PANEL = 1024


@functools.cache
def kernel_available() -> bool:
    """Whether the AVX-512 BF16 kernel is built and this CPU runs it (asked once: every batch of every layer
    asks)."""
    try:
        from llmc.quant import _gram
    except ImportError:  # a source tree whose extensions were not built: torch's GEMMs do the work
        return False
    return bool(_gram.available())


def add_upper(gram, x, dtype) -> None:
    """``gram [K, K] += xᵀx`` on and above the diagonal (``x [T, K]``), with ``dtype`` the GEMM's input precision:
    bfloat16 rounds ``x`` to bfloat16 first; float32 reads it as it is (a bfloat16 ``x`` exactly).

    When the kernel runs here, every bfloat16 input (a bfloat16 ``x``, or any ``x`` at ``dtype`` bfloat16) goes
    through it: exact products summed in float32. Otherwise torch's GEMMs: float32 accumulated by the GEMM itself
    (beta = 1, no temporary); bfloat16 with each panel's product rounded to bfloat16 (2^-9 relative per entry)
    and added in float32. Entries below the diagonal may be written too; :func:`mirror_upper` overwrites them."""
    import torch

    if gram.device.type != "cpu":
        # On a GPU: float32 GEMMs (no TF32) of the inputs at dtype's precision, the kernel's arithmetic; the
        # bfloat16 rate is not worth the output rounding there.
        x, dtype = (x.to(dtype) if dtype != x.dtype else x).float(), torch.float32
    elif (x.dtype == torch.bfloat16 or dtype == torch.bfloat16) and kernel_available():
        from llmc.quant import _gram

        pairs = token_pairs(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16))
        _gram.add_upper(gram.numpy(), pairs.numpy().view(np.uint32), torch.get_num_threads())
        return
    xg = x if dtype == x.dtype else x.to(dtype)
    xt = xg.T
    for i in range(0, gram.shape[0], GRAM_PANEL):
        panel = gram[i : i + GRAM_PANEL, i:]
        if dtype == panel.dtype:
            panel.addmm_(xt[i : i + GRAM_PANEL], xg[:, i:])
        else:
            panel.add_(xt[i : i + GRAM_PANEL] @ xg[:, i:])


def token_pairs(x):
    """int32 ``[ceil(T / 2), Kp]`` view of bfloat16 ``x [T, K]`` as the kernel reads it: element ``[t, k]`` holds
    ``(x[2t, k], x[2t + 1, k])``, the operand pairs of VDPBF16PS; T padded to even and K to a multiple of 32 with
    zeros."""
    import torch

    t, k = x.shape
    x = torch.nn.functional.pad(x, (0, -k % 32, 0, t % 2))
    return x.view(-1, 2, x.shape[1]).transpose(1, 2).contiguous().view(torch.int32)[..., 0]


def mirror_upper(g) -> None:
    """Copy ``g [K, K]``'s upper triangle onto its lower one, a ``GRAM_PANEL`` block at a time (4x faster than
    whole-matrix ``triu`` temporaries at K = 8192 here, and no K x K scratch)."""
    import torch

    k = g.shape[0]
    for i in range(0, k, GRAM_PANEL):
        d = g[i : i + GRAM_PANEL, i : i + GRAM_PANEL]
        d.copy_(torch.triu(d) + torch.triu(d, 1).T)
        if i + GRAM_PANEL < k:
            g[i + GRAM_PANEL :, i : i + GRAM_PANEL].copy_(g[i : i + GRAM_PANEL, i + GRAM_PANEL :].T)
