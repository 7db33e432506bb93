"""AOT requests for the grouped MXFP4 expert kernel (:mod:`.triton_kernel`; no Triton import: the compiler plans
with these), in the form :func:`llmc.plugins.triton_aot.compile_requests` compiles (plus ``key``, ``op`` and
``grid_rule`` for the manifest, as :mod:`llmc.plugins.fused.requests`)."""

from __future__ import annotations

MODULE = "llmc.plugins.mxfp4.triton_kernel"
WIDE_SUFFIX = "+wide"  # the wide tiling's key: the node's ``kernel`` attribute plus this

# Two tilings per expert weight, both reading the stored codes once per (expert, row block, column block); neither is
# timed on a GPU yet (issue 51), the shapes are the usual Triton matmul tiles for sm_90:
# - "decode": 16 rows (the smallest tl.dot tile; a decode step routes a few rows to each expert) x 64 columns.
# - "wide": 64 x 128, 3 pipeline stages, once the routed rows average more than DECODE_ROWS_PER_EXPERT per expert
#   (prefill chunks): each code tile is decoded once per 64 rows instead of once per 16 (the decode runs on CUDA
#   cores, the products on tensor cores), and an expert's codes are read a quarter as often.
DECODE_BLOCK_M, DECODE_BLOCK_N = 16, 64
WIDE_BLOCK_M, WIDE_BLOCK_N = 64, 128
DECODE_ROWS_PER_EXPERT = 16


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def moe_request(experts: int, n: int, k: int, act: str, wide: bool = False) -> dict:
    """The grouped kernel for one expert weight ``blocks [experts, n, k/32, 16]`` with activations ``act`` (a Triton
    dtype name); ``wide``: the tiling for many rows per expert."""
    if k % 32:
        raise ValueError(f"MXFP4 expert weight with K = {k}: not whole 32-blocks")
    block_k = 64 if k % 64 == 0 else 32
    key = f"mxfp4_moe-e{experts}-n{n}-k{k}-{act}"
    return {
        "key": key + (WIDE_SUFFIX if wide else ""), "op": "mxfp4_moe", "module": MODULE, "fn": "mxfp4_moe_kernel",
        "signature": {"x_ptr": f"*{act}", "ids_ptr": "*i64", "order_ptr": "*i64", "blocks_ptr": "*u8",
                      "scales_ptr": "*u8", "out_ptr": f"*{act}", "m_rows": "i32", "x_stride": "i32", "steps": "i32",
                      "E": "constexpr", "N": "constexpr", "K": "constexpr", "E_PAD": "constexpr",
                      "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        "constexprs": {"E": experts, "N": n, "K": k, "E_PAD": max(2, _pow2(experts)),
                       "BLOCK_M": WIDE_BLOCK_M if wide else DECODE_BLOCK_M,
                       "BLOCK_N": WIDE_BLOCK_N if wide else DECODE_BLOCK_N, "BLOCK_K": block_k},
        "num_warps": 4, "num_stages": 3 if wide else 2,
        "divisible": ["ids_ptr", "order_ptr", "blocks_ptr", "scales_ptr", "out_ptr"],
        "grid_rule": "(cdiv(N, BLOCK_N), cdiv(m_rows, BLOCK_M) + min(E, m_rows), 1)",
    }


def moe_launch(config: dict, rows: int) -> tuple[int, int, int]:
    """The grid of one launch over ``rows`` routed rows (``config``: the kernel's constexprs)."""
    return (-(-config["N"] // config["BLOCK_N"]), -(-rows // config["BLOCK_M"]) + min(config["E"], rows), 1)


def use_wide(rows: int, experts: int) -> bool:
    """Whether ``rows`` routed rows over ``experts`` experts take the wide tiling (see the comment above)."""
    return rows > DECODE_ROWS_PER_EXPERT * experts
