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


# W4A16 (int4_matmul_kernel): two compiled tilings per linear, both reading the packed codes, the launch picking by
# the rows of the call (nothing dequantizes a weight at any row count). Neither is timed yet on a GPU (issue 51:
# the configurations are the usual Triton matmul shapes for sm_90, to be revisited with the GPU figures).
# - "decode", rows <= INT4_BLOCK_M: 16-row tiles (the smallest tl.dot tile: a decode step's rows waste nothing) by 64
#   columns, K in blocks of up to 128; the weight is read once and the grid filled by splitting K (int4_launch).
# - "wide", more rows (batches past 16, prefill chunks of 512-2048 rows): 64 x 128 tiles, K in blocks of up to 64,
#   3 pipeline stages: each weight tile is unpacked and scaled once per 64 rows instead of once per 16 (the
#   dequantization, on CUDA cores, is what a 16-row tile spends most of its time on when rows are many), and
#   the x / code tiles of three K blocks in flight hide the loads' latency (64x64 bf16 + 32x128 codes per stage:
#   ~12 KiB x 3, well inside the SM's shared memory).
INT4_BLOCK_M = 16
INT4_BLOCK_N = 64
INT4_WIDE_BLOCK_M = 64
INT4_WIDE_BLOCK_N = 128
INT4_WIDE_SUFFIX = "+wide"  # the wide tiling's key: the node's ``kernel`` attribute plus this
INT4_NUM_SMS = 132  # H100 SXM; the session passes the device's own count (FusedOps.num_sms)


def int4_split_k(n: int, k: int, block_k: int, num_sms: int = INT4_NUM_SMS, rows: int = 1,
                 block_m: int = INT4_BLOCK_M, block_n: int = INT4_BLOCK_N) -> int:
    """Split K so that about two programs run per SM (a power of two, each split at least one K block), no further
    than keeps the float32 partials (``split x rows x N`` written and read back, 8 bytes each) within half the packed
    weight's bytes (``K x N / 2``): past that the split costs more traffic than the idle SMs it fills."""
    tiles = -(-n // block_n) * -(-rows // block_m)
    want = max(1, (2 * num_sms) // tiles)
    most = max(1, min(k // block_k, k // (32 * max(1, rows))))
    split = 1
    while split * 2 <= min(want, most):
        split *= 2
    return split


def int4_launch(config: dict, rows: int, num_sms: int = INT4_NUM_SMS) -> tuple[tuple[int, int, int], int, int]:
    """The grid, split and K-chunk of one int4_matmul_kernel launch over ``rows`` rows (``config``: its constexprs)."""
    n, k, bk, bm, bn = config["N"], config["K"], config["BLOCK_K"], config["BLOCK_M"], config["BLOCK_N"]
    chunk = _ceil(_ceil(k, int4_split_k(n, k, bk, num_sms, rows, bm, bn)), bk) * bk
    split = _ceil(k, chunk)  # the K blocks may not divide evenly: no program without a K block of its own
    return (_ceil(n, bn), split, _ceil(rows, bm)), split, chunk


def int4_matmul_request(n: int, k: int, group: int, has_zero: bool, act: str, wide: bool = False) -> dict:
    """W4A16 matmul of one linear: the "decode" tiling (``M <= INT4_BLOCK_M`` rows) or, ``wide``, the tiling for more
    rows (see the comment above ``INT4_BLOCK_M``)."""
    block_k = min(group, 64 if wide else 128)
    if group % block_k or block_k < 16:
        raise ValueError(f"int4 group size {group}: the W4A16 kernel needs a multiple of 16 up to 128, or of 128")
    key = f"int4_matmul-n{n}-k{k}-g{group}-z{int(has_zero)}-{act}"
    return {
        "key": key + (INT4_WIDE_SUFFIX if wide else ""), "op": "int4_matmul", "module": MODULE,
        "fn": "int4_matmul_kernel",
        "signature": {"x_ptr": f"*{act}", "q_ptr": "*u8", "s_ptr": f"*{act}", "z_ptr": "*u8", "out_ptr": f"*{act}",
                      "part_ptr": "*fp32", "m_rows": "i32", "x_stride": "i32", "split_k": "i32", "chunk": "i32",
                      "N": "constexpr", "K": "constexpr", "GROUP": "constexpr", "BLOCK_M": "constexpr",
                      "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "HAS_ZERO": "constexpr"},
        "constexprs": {"N": n, "K": k, "GROUP": group, "BLOCK_M": INT4_WIDE_BLOCK_M if wide else INT4_BLOCK_M,
                       "BLOCK_N": INT4_WIDE_BLOCK_N if wide else INT4_BLOCK_N, "BLOCK_K": block_k,
                       "HAS_ZERO": bool(has_zero)},
        "num_warps": 4, "num_stages": 3 if wide else 2, "divisible": ["q_ptr", "s_ptr", "out_ptr", "part_ptr"],
        "grid_rule": "(cdiv(N, BLOCK_N), split_k, cdiv(m_rows, BLOCK_M))",
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


ENCODER_MODULE = "llmc.plugins.fused.encoder_kernels"
GELU_BLOCK = 1024


def layer_norm_request(n: int, eps: float, bias: bool, act: str, weight: str) -> dict:
    """LayerNorm over rows of ``n`` (``bias``: with a bias). ``act``/``weight``: Triton dtype names."""
    block = _pow2(n)
    return {
        "key": f"layer_norm-n{n}-e{eps!r}-b{int(bias)}-{act}-{weight}", "op": "layer_norm", "module": ENCODER_MODULE,
        "fn": "layer_norm_kernel",
        "signature": {"x_ptr": f"*{act}", "w_ptr": f"*{weight}", "b_ptr": f"*{weight}", "out_ptr": f"*{act}",
                      "n_rows": "i32", "N": "constexpr", "BLOCK": "constexpr", "EPS": "constexpr",
                      "HAS_BIAS": "constexpr"},
        "constexprs": {"N": n, "BLOCK": block, "EPS": float(eps), "HAS_BIAS": bool(bias)},
        "num_warps": 4 if block <= 2048 else 8, "divisible": ["out_ptr"], "grid_rule": "(n_rows, 1, 1)",
    }


def gelu_request(n: int, approximate: str, act: str) -> dict:
    """GELU over rows of ``n``: ``approximate`` ``"none"`` (erf) or ``"tanh"``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate={approximate!r}: 'none' or 'tanh'")
    block = min(GELU_BLOCK, _pow2(n))
    return {
        "key": f"gelu-n{n}-{approximate}-{act}", "op": "gelu", "module": ENCODER_MODULE, "fn": "gelu_kernel",
        "signature": {"x_ptr": f"*{act}", "out_ptr": f"*{act}", "n_rows": "i32", "N": "constexpr",
                      "BLOCK": "constexpr", "TANH": "constexpr"},
        "constexprs": {"N": n, "BLOCK": block, "TANH": approximate == "tanh"},
        "num_warps": 4, "divisible": ["out_ptr"], "grid_rule": "(n_rows, cdiv(N, BLOCK), 1)",
    }
