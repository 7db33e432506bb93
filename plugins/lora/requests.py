"""AOT requests for the LoRA shrink/expand kernels of :mod:`.triton_kernels` (no Triton import: the compiler plans
with these; :func:`llmc.plugins.triton_aot.compile_requests` compiles them)."""

from __future__ import annotations

MODULE = "llmc.plugins.lora.triton_kernels"
BLOCK_K = 64
BLOCK_N = 64


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def shrink_request(k: int, rank: int, slots: int, act: str) -> dict:
    """``u = x @ A_slot`` for rows of ``k`` (``act``: the activations' Triton dtype; A in it too)."""
    return {
        "key": f"lora_shrink-k{k}-r{rank}-s{slots}-{act}", "op": "lora_shrink", "module": MODULE,
        "fn": "lora_shrink_kernel",
        "signature": {"x_ptr": f"*{act}", "a_ptr": f"*{act}", "slot_ptr": "*i64", "u_ptr": "*fp32",
                      "n_tokens": "i32", "x_stride": "i32", "K": "constexpr", "R": "constexpr", "S": "constexpr",
                      "R_PAD": "constexpr", "BLOCK_K": "constexpr"},
        "constexprs": {"K": k, "R": rank, "S": slots, "R_PAD": max(16, _pow2(rank)), "BLOCK_K": BLOCK_K},
        "num_warps": 4, "divisible": [], "grid_rule": "(n_tokens, 1, 1)",
    }


def expand_request(n: int, rank: int, slots: int, act: str) -> dict:
    """``out = y + u @ B_slot`` for rows of ``n``."""
    return {
        "key": f"lora_expand-n{n}-r{rank}-s{slots}-{act}", "op": "lora_expand", "module": MODULE,
        "fn": "lora_expand_kernel",
        "signature": {"u_ptr": "*fp32", "b_ptr": f"*{act}", "slot_ptr": "*i64", "y_ptr": f"*{act}",
                      "out_ptr": f"*{act}", "n_tokens": "i32", "y_stride": "i32", "N": "constexpr",
                      "R": "constexpr", "S": "constexpr", "R_PAD": "constexpr", "BLOCK_N": "constexpr"},
        "constexprs": {"N": n, "R": rank, "S": slots, "R_PAD": max(16, _pow2(rank)), "BLOCK_N": BLOCK_N},
        "num_warps": 4, "divisible": [], "grid_rule": "(n_tokens, cdiv(N, BLOCK_N), 1)",
    }
