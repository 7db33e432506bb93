"""AOT requests for the recurrent-state kernels of :mod:`.triton_kernels` (no Triton import: the compiler plans with
these; :func:`llmc.plugins.triton_aot.compile_requests` compiles them). Each is keyed by the op's shape attributes and
the activation dtype; the CUDA session launches one per program node whose ``kernel`` attribute names it."""

from __future__ import annotations

MODULE = "llmc.plugins.recurrent.triton_kernels"
CONV_BLOCK_C = 128
# torch.finfo(float32).max: a constexpr stands in for dt_max = inf (no dt_limit), which PTX constants cannot spell
_F32_MAX = 3.4028234663852886e38


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_META = {"slot_ptr": "*i64", "ctx_ptr": "*i64", "qsl_ptr": "*i64", "state_ptr": "*fp32"}


def conv_request(channels: int, width: int, has_bias: bool, silu: bool, act: str) -> dict:
    """Causal depthwise conv1d over ``channels`` with ``width`` taps (``act``: the activations' Triton dtype)."""
    return {
        "key": f"causal_conv1d-c{channels}-k{width}-b{int(has_bias)}-a{int(silu)}-{act}", "op": "causal_conv1d",
        "module": MODULE, "fn": "causal_conv1d_kernel",
        "signature": {"x_ptr": f"*{act}", "w_ptr": f"*{act}", "bias_ptr": f"*{act}", **_META, "out_ptr": f"*{act}",
                      "C": "constexpr", "K": "constexpr", "KM1_PAD": "constexpr", "HAS_BIAS": "constexpr",
                      "SILU": "constexpr", "BLOCK_C": "constexpr"},
        "constexprs": {"C": channels, "K": width, "KM1_PAD": _pow2(max(1, width - 1)), "HAS_BIAS": bool(has_bias),
                       "SILU": bool(silu), "BLOCK_C": min(CONV_BLOCK_C, _pow2(channels))},
        "num_warps": 4, "divisible": [], "grid_rule": "(num_seqs, cdiv(C, BLOCK_C), 1)",
    }


def delta_request(num_k_heads: int, num_v_heads: int, dk: int, dv: int, l2norm: bool, act: str) -> dict:
    """The gated delta rule for ``num_v_heads`` value heads of ``dv`` reading ``num_k_heads`` key heads of ``dk``."""
    block_v = min(32, _pow2(dv))
    return {
        "key": f"gated_delta_rule-hk{num_k_heads}-hv{num_v_heads}-dk{dk}-dv{dv}-n{int(l2norm)}-{act}",
        "op": "gated_delta_rule", "module": MODULE, "fn": "gated_delta_kernel",
        "signature": {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "v_ptr": f"*{act}", "g_ptr": f"*{act}",
                      "beta_ptr": f"*{act}", **_META, "out_ptr": f"*{act}", "HK": "constexpr", "HV": "constexpr",
                      "DK": "constexpr", "DV": "constexpr", "DK_PAD": "constexpr", "BLOCK_V": "constexpr",
                      "L2NORM": "constexpr", "SCALE": "constexpr"},
        "constexprs": {"HK": num_k_heads, "HV": num_v_heads, "DK": dk, "DV": dv, "DK_PAD": max(16, _pow2(dk)),
                       "BLOCK_V": max(16, block_v), "L2NORM": bool(l2norm), "SCALE": float(dk ** -0.5)},
        "num_warps": 4, "divisible": [], "grid_rule": "(num_seqs, HV, cdiv(DV, BLOCK_V))",
    }


def ssd_request(num_heads: int, n_groups: int, head_dim: int, state_size: int, dt_min: float, dt_max: float,
                act: str) -> dict:
    """Mamba2's scan for ``num_heads`` heads of ``head_dim`` with ``n_groups`` B/C groups of ``state_size``."""
    dt_max = min(float(dt_max), _F32_MAX)
    return {
        "key": f"ssd_scan-h{num_heads}-g{n_groups}-p{head_dim}-n{state_size}-t{float(dt_min)!r}-{dt_max!r}-{act}",
        "op": "ssd_scan", "module": MODULE, "fn": "ssd_scan_kernel",
        "signature": {"x_ptr": f"*{act}", "b_ptr": f"*{act}", "c_ptr": f"*{act}", "dt_ptr": f"*{act}",
                      "alog_ptr": f"*{act}", "d_ptr": f"*{act}", "dtb_ptr": f"*{act}", **_META,
                      "out_ptr": f"*{act}", "H": "constexpr", "G": "constexpr", "P": "constexpr", "N": "constexpr",
                      "N_PAD": "constexpr", "BLOCK_P": "constexpr", "DT_MIN": "constexpr", "DT_MAX": "constexpr"},
        "constexprs": {"H": num_heads, "G": n_groups, "P": head_dim, "N": state_size,
                       "N_PAD": max(16, _pow2(state_size)), "BLOCK_P": max(16, min(32, _pow2(head_dim))),
                       "DT_MIN": float(dt_min), "DT_MAX": dt_max},
        "num_warps": 4, "divisible": [], "grid_rule": "(num_seqs, H, cdiv(P, BLOCK_P))",
    }
