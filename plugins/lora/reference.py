"""The LoRA slot update in torch: what the CUDA engine's ``LoraApply`` node computes (the CPU executor runs it, the
Triton kernels are held to it), and what the graph's standard ops (llmc.passes.lora) compute.

``y + B_s(A_s x)`` per token, ``s`` its slot: ``x`` ``[..., K]``, ``y`` ``[..., N]``, ``a`` ``[K, S*R]``,
``b`` ``[S*R, N]``, ``slots`` ``[T]`` (T = the rows of x; 0 or -1: no adapter). Tokens are grouped by slot, so
each adapter is one pair of GEMMs over its tokens.
"""

from __future__ import annotations

import torch


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
               rank: int) -> torch.Tensor:
    shape = y.shape
    x2 = x.reshape(-1, x.shape[-1])
    out = y.reshape(-1, shape[-1]).clone()
    num_slots = a.shape[1] // rank
    for s in torch.unique(slots).tolist():
        if not 1 <= s <= num_slots:
            continue
        rows = (slots == s).nonzero().flatten()
        cols = slice((s - 1) * rank, s * rank)
        u = x2[rows].float() @ a[:, cols].float()
        out[rows] = (out[rows].float() + u @ b[cols].float()).to(out.dtype)
    return out.reshape(shape)
