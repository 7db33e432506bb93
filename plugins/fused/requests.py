"""AOT requests for the fused kernels of :mod:`.triton_kernels` (no Triton import: the compiler plans with these).

Each request is what :func:`llmc.plugins.triton_aot.compile_requests` compiles, plus ``key`` (the program
node's ``kernel`` attribute names it), ``op`` and ``grid_rule`` for the manifest.
"""

from __future__ import annotations

MODULE = "llmc.plugins.fused.triton_kernels"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


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


INT4_BLOCK_M = 16  # decode rows per launch; more rows dequantize into a torch matmul instead
INT4_BLOCK_N = 64


def int4_split_k(n: int, k: int, block_k: int, num_sms: int = 132) -> int:
    """Split K so that about two programs run per SM (a power of two, each split at least one K block)."""
    tiles = -(-n // INT4_BLOCK_N)
    want = max(1, (2 * num_sms) // tiles)
    most = max(1, k // block_k)
    split = 1
    while split * 2 <= min(want, most):
        split *= 2
    return split


def int4_matmul_request(n: int, k: int, group: int, has_zero: bool, act: str) -> dict:
    """W4A16 matmul for ``M <= INT4_BLOCK_M`` rows (decode); split-K sized for a 132-SM GPU."""
    block_k = min(group, 128)
    if group % block_k or block_k < 16:
        raise ValueError(f"int4 group size {group}: the W4A16 kernel needs a multiple of 16 up to 128, or of 128")
    split = int4_split_k(n, k, block_k)
    out = "fp32" if split > 1 else act
    return {
        "key": f"int4_matmul-n{n}-k{k}-g{group}-z{int(has_zero)}-{act}", "op": "int4_matmul", "module": MODULE,
        "fn": "int4_matmul_kernel",
        "signature": {"x_ptr": f"*{act}", "q_ptr": "*u8", "s_ptr": f"*{act}", "z_ptr": "*u8", "out_ptr": f"*{out}",
                      "m_rows": "i32", "x_stride": "i32", "N": "constexpr", "K": "constexpr", "GROUP": "constexpr",
                      "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
                      "CHUNK": "constexpr", "HAS_ZERO": "constexpr"},
        "constexprs": {"N": n, "K": k, "GROUP": group, "BLOCK_M": INT4_BLOCK_M, "BLOCK_N": INT4_BLOCK_N,
                       "BLOCK_K": block_k, "SPLIT_K": split, "CHUNK": _ceil(_ceil(k, split), block_k) * block_k,
                       "HAS_ZERO": bool(has_zero)},
        "num_warps": 4, "divisible": ["q_ptr", "s_ptr", "out_ptr"], "grid_rule": "(cdiv(N, BLOCK_N), SPLIT_K, 1)",
    }


FP8_MODULE = "llmc.plugins.fused.fp8_kernels"


def rms_norm_fp8_request(n: int, eps: float, skip: bool, act: str, weight: str) -> dict:
    """RMSNorm (``skip``: the residual add first) whose normalized rows leave as E4M3 codes with a static scale."""
    base = rms_norm_request(n, eps, skip, act, weight)
    sig = base["signature"]
    sig = {"x_ptr": sig["x_ptr"], "skip_ptr": sig["skip_ptr"], "w_ptr": sig["w_ptr"], "scale_ptr": "*fp32",
           "out_ptr": "*u8", **{k: v for k, v in sig.items() if k not in ("x_ptr", "skip_ptr", "w_ptr", "out_ptr")}}
    return {**base, "key": "fp8-" + base["key"], "op": "rms_norm_fp8", "module": FP8_MODULE,
            "fn": "rms_norm_fp8_kernel", "signature": sig}


def swiglu_fp8_request(n: int, act: str) -> dict:
    """silu(gate) * up over rows of ``n``, leaving as E4M3 codes with a static scale."""
    base = swiglu_request(n, act)
    return {**base, "key": "fp8-" + base["key"], "op": "swiglu_fp8", "module": FP8_MODULE, "fn": "swiglu_fp8_kernel",
            "signature": {"g_ptr": f"*{act}", "u_ptr": f"*{act}", "scale_ptr": "*fp32", "out_ptr": "*u8",
                          "n_rows": "i32", "g_stride": "i32", "u_stride": "i32", "N": "constexpr",
                          "BLOCK": "constexpr"}}


def fp8_quantize_request(n: int, act: str) -> dict:
    """Rows of ``n`` activations to E4M3 codes with a static scale (an FP8 linear's input where no kernel before it
    can emit them)."""
    block = min(SWIGLU_BLOCK, _pow2(n))
    return {
        "key": f"fp8_quantize-n{n}-{act}", "op": "fp8_quantize", "module": FP8_MODULE, "fn": "fp8_quantize_kernel",
        "signature": {"x_ptr": f"*{act}", "scale_ptr": "*fp32", "out_ptr": "*u8", "n_rows": "i32", "x_stride": "i32",
                      "N": "constexpr", "BLOCK": "constexpr"},
        "constexprs": {"N": n, "BLOCK": block},
        "num_warps": 4, "divisible": ["out_ptr"], "grid_rule": "(n_rows, cdiv(N, BLOCK), 1)",
    }
