"""AOT requests for the fused kernels of :mod:`.triton_kernels` (no Triton import: the compiler plans with these).

Each request is what :func:`llmc.plugins.triton_aot.compile_requests` compiles, plus ``key`` (the program
node's ``kernel`` attribute names it), ``op`` and ``grid_rule`` for the manifest.
"""

from __future__ import annotations

MODULE = "llmc.plugins.fused.triton_kernels"


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def rms_norm_request(n: int, eps: float, skip: bool, act: str, weight: str) -> dict:
    """RMSNorm over rows of ``n`` (``skip``: the residual add first). ``act``/``weight``: Triton dtype names."""
    block = _pow2(n)
    return {
        "key": f"rms_norm-n{n}-e{eps!r}-s{int(skip)}-{act}-{weight}", "op": "rms_norm", "module": MODULE,
        "fn": "rms_norm_kernel",
        "signature": {"x_ptr": f"*{act}", "skip_ptr": f"*{act}", "w_ptr": f"*{weight}", "out_ptr": f"*{act}",
                      "sum_ptr": f"*{act}", "n_rows": "i32", "N": "constexpr", "BLOCK": "constexpr",
                      "EPS": "constexpr", "HAS_SKIP": "constexpr", "ROUND_Y": "constexpr"},
        "constexprs": {"N": n, "BLOCK": block, "EPS": float(eps), "HAS_SKIP": bool(skip), "ROUND_Y": weight != "fp32"},
        "num_warps": 4 if block <= 2048 else 8, "divisible": ["w_ptr", "out_ptr", "sum_ptr"],
        "grid_rule": "(n_rows, 1, 1)",
    }


def rotary_request(heads: int, head_size: int, act: str) -> dict:
    """Rotate-half rotary over ``heads`` heads of ``head_size``, cos/sin in float32."""
    return {
        "key": f"rotary-h{heads}-d{head_size}-{act}", "op": "rotary", "module": MODULE, "fn": "rotary_kernel",
        "signature": {"x_ptr": f"*{act}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": f"*{act}",
                      "n_tokens": "i32", "x_stride": "i32", "H": "constexpr", "D": "constexpr",
                      "HALF_PAD": "constexpr"},
        "constexprs": {"H": heads, "D": head_size, "HALF_PAD": max(16, _pow2(head_size // 2))},
        "num_warps": 1, "divisible": ["out_ptr"], "grid_rule": "(n_tokens, H, 1)",
    }


SWIGLU_BLOCK = 1024


def swiglu_request(n: int, act: str) -> dict:
    """silu(gate) * up over rows of ``n``."""
    block = min(SWIGLU_BLOCK, _pow2(n))
    return {
        "key": f"swiglu-n{n}-{act}", "op": "swiglu", "module": MODULE, "fn": "swiglu_kernel",
        "signature": {"g_ptr": f"*{act}", "u_ptr": f"*{act}", "out_ptr": f"*{act}", "n_rows": "i32",
                      "g_stride": "i32", "u_stride": "i32", "N": "constexpr", "BLOCK": "constexpr"},
        "constexprs": {"N": n, "BLOCK": block},
        "num_warps": 4, "divisible": ["out_ptr"], "grid_rule": "(n_rows, cdiv(N, BLOCK), 1)",
    }
