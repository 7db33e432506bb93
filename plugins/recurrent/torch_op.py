"""``torch.ops.llmc.causal_conv1d``: the custom op the frontend puts in place of transformers' causal conv1d.

Tracing needs only its fake implementation; the eager one runs the numpy reference against the state
pool bound by :func:`llmc.plugins.recurrent.state_binding.bound_state`.
"""

from __future__ import annotations

import numpy as np
import torch

from llmc.plugins.recurrent import (
    CONV_OP_TYPE,
    DELTA_OP_TYPE,
    DOMAIN,
    OPSET_VERSION,
    SSD_OP_TYPE,
    reference,
    state_binding,
)


@torch.library.custom_op("llmc::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state_slots: torch.Tensor,
                  context_lens: torch.Tensor, query_start_loc: torch.Tensor, state_idx: int,
                  activation: int) -> torch.Tensor:
    out = reference.causal_conv1d(
        x.detach().float().numpy(), weight.detach().float().numpy(),
        None if bias is None else bias.detach().float().numpy(), state_slots.numpy(), context_lens.numpy(),
        query_start_loc.numpy(), state_binding.state_array(state_idx), activation)
    return torch.from_numpy(np.ascontiguousarray(out)).to(x.dtype)


@causal_conv1d.register_fake
def _(x, weight, bias, state_slots, context_lens, query_start_loc, state_idx, activation):
    return torch.empty_like(x)


def onnx_translation(x, weight, bias, state_slots, context_lens, query_start_loc, state_idx: int, activation: int):
    """Lowering for ``torch.onnx.export(custom_translation_table=...)``: one ``llmc.CausalConv1d`` node."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    return getattr(opset, CONV_OP_TYPE)(x, weight, bias, state_slots, context_lens, query_start_loc,
                                        state_idx=state_idx, activation=activation)


@torch.library.custom_op("llmc::gated_delta_rule", mutates_args=())
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_slots: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     state_idx: int, num_k_heads: int, num_v_heads: int, use_qk_l2norm: int) -> torch.Tensor:
    def f(t):
        return t.detach().float().numpy()

    state = state_binding.state_array(state_idx)
    out = reference.gated_delta_rule(f(query), f(key), f(value), f(g), f(beta), state_slots.numpy(),
                                     context_lens.numpy(), query_start_loc.numpy(), state, num_k_heads, num_v_heads,
                                     bool(use_qk_l2norm))
    return torch.from_numpy(np.ascontiguousarray(out)).to(query.dtype)


@gated_delta_rule.register_fake
def _(query, key, value, g, beta, state_slots, context_lens, query_start_loc, state_idx, num_k_heads, num_v_heads,
      use_qk_l2norm):
    return torch.empty_like(value)


def delta_onnx_translation(query, key, value, g, beta, state_slots, context_lens, query_start_loc, state_idx: int,
                           num_k_heads: int, num_v_heads: int, use_qk_l2norm: int):
    """Lowering for ``torch.onnx.export(custom_translation_table=...)``: one ``llmc.GatedDeltaRule`` node."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    return getattr(opset, DELTA_OP_TYPE)(query, key, value, g, beta, state_slots, context_lens, query_start_loc,
                                         state_idx=state_idx, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                         use_qk_l2norm=use_qk_l2norm)


@torch.library.custom_op("llmc::ssd_scan", mutates_args=())
def ssd_scan(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor,
             d: torch.Tensor, dt_bias: torch.Tensor, state_slots: torch.Tensor, context_lens: torch.Tensor,
             query_start_loc: torch.Tensor, state_idx: int, num_heads: int, n_groups: int, dt_min: float,
             dt_max: float) -> torch.Tensor:
    def f(t):
        return t.detach().float().numpy()

    out = reference.ssd_scan(f(x), f(b), f(c), f(dt), f(a_log), f(d), f(dt_bias), state_slots.numpy(),
                             context_lens.numpy(), query_start_loc.numpy(), state_binding.state_array(state_idx),
                             num_heads, n_groups, dt_min, dt_max)
    return torch.from_numpy(np.ascontiguousarray(out)).to(x.dtype)


@ssd_scan.register_fake
def _(x, b, c, dt, a_log, d, dt_bias, state_slots, context_lens, query_start_loc, *attrs):
    return torch.empty_like(x)


def ssd_onnx_translation(x, b, c, dt, a_log, d, dt_bias, state_slots, context_lens, query_start_loc, state_idx: int,
                         num_heads: int, n_groups: int, dt_min: float, dt_max: float):
    """Lowering for ``torch.onnx.export(custom_translation_table=...)``: one ``llmc.SsdScan`` node."""
    import onnxscript

    opset = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    return getattr(opset, SSD_OP_TYPE)(x, b, c, dt, a_log, d, dt_bias, state_slots, context_lens, query_start_loc,
                                       state_idx=state_idx, num_heads=num_heads, n_groups=n_groups, dt_min=dt_min,
                                       dt_max=dt_max)
