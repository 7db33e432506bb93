"""ALiBi families whose attention is computed inline (bloom, mpt): their attention forward emits llmc's op.

transformers' bloom and mpt attention modules do not call an ``AttentionInterface`` function: they compute
``softmax(q k^T * scale + alibi + mask) v`` themselves, with the ALiBi bias built once per forward by the model
(bloom: ``slope_h * k_pos``; mpt: ``slope_h * (k_pos - (L - 1))``, the same up to a constant per row). For the
trace, each such module's ``forward`` is replaced, on the instance, by one that computes Q, K and V exactly as
transformers does, hands them to llmc's paged attention (``attention_hook.attention``) with ALiBi as the op's
``alibi_max_bias`` attribute (the slopes the kernels compute, checked here against the model's own), and applies
the output projection as transformers does. The model's alibi tensor and mask are then unused (dead in the graph).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from llmc.errors import UnsupportedError

# Standard ALiBi (Press et al.): the largest bias of the slope geometric sequence. bloom's _get_alibi_slopes and
# mpt's build_mpt_alibi_tensor (which MptModel calls with its default alibi_bias_max) both use 8.
MAX_BIAS = 8.0


def _bloom_slopes(module, num_heads: int) -> np.ndarray:
    import sys

    return sys.modules[type(module).__module__]._get_alibi_slopes(num_heads, "cpu").numpy()


def _mpt_slopes(module, num_heads: int) -> np.ndarray:
    import sys

    bias = sys.modules[type(module).__module__].build_mpt_alibi_tensor(num_heads, 2)  # slope * (j - 1), j = 0, 1
    return (bias[:, 0, 1] - bias[:, 0, 0]).numpy()


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BloomAttention.forward on packed tokens through llmc's attention (transformers' projections and
    tensor-parallel output slices, its ALiBi as the op's attribute)."""
    import sys

    import torch.nn.functional as F

    from llmc.compiler.attention_hook import attention

    batch, tokens, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # [1, H, T, D] each
    out, _ = attention(self, query, key, value, None, scaling=self.inv_norm_factor, alibi_max_bias=MAX_BIAS)
    context = out.reshape(batch, tokens, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = None
        for i in range(self.pretraining_tp):  # as transformers: the slices' products summed, no dense bias
            part = F.linear(context[:, :, int(i * slices):int((i + 1) * slices)],
                            self.dense.weight[:, int(i * slices):int((i + 1) * slices)])
            output = part if output is None else output + part
    else:
        output = self.dense(context)
    dropout_add = sys.modules[type(self).__module__].dropout_add
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    """MptAttention.forward on packed tokens through llmc's attention (transformers' QKV projection and clipping,
    its ALiBi as the op's attribute)."""
    from llmc.compiler.attention_hook import attention

    batch, tokens = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(batch, tokens, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    out, _ = attention(self, q, k, v, None, scaling=self.softmax_scale, alibi_max_bias=MAX_BIAS)
    return self.out_proj(out.reshape(batch, tokens, self.n_heads * self.head_dim)), None


def _mpt_model_forward(self, *args, **kwargs):
    """MptModel.forward, with transformers' ``create_causal_mask`` giving a placeholder where it gives no mask (as
    for llmc's attention implementation): MptModel calls ``.to(torch.bool)`` on it, and llmc's attention reads
    none."""
    import sys

    import torch

    module = sys.modules[type(self).__module__]
    original = module.create_causal_mask

    def create_causal_mask(*a, **k):
        mask = original(*a, **k)
        return mask if mask is not None else torch.zeros((), dtype=torch.bool)

    module.create_causal_mask = create_causal_mask
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        module.create_causal_mask = original


# Model class name -> its replacement forward (around the model-level code the replaced attention needs no more).
_MODELS: dict[str, Callable] = {"MptModel": _mpt_model_forward}

# Attention class name -> (its replacement forward, the model's own slopes, the attribute holding the head count).
_FAMILIES: dict[str, tuple[Callable, Callable, str]] = {
    "BloomAttention": (_bloom_forward, _bloom_slopes, "num_heads"),
    "MptAttention": (_mpt_forward, _mpt_slopes, "n_heads"),
}


def install(hf) -> int:
    """Replace the forward of every inline-ALiBi attention module of ``hf`` (bloom, mpt) by llmc's, after checking
    that the model's slopes are the standard ones the kernels compute. Returns how many were replaced."""
    from llmc.plugins.paged_attention.reference import alibi_slopes

    count = 0
    checked: set[str] = set()
    for module in hf.modules():
        if type(module).__name__ in _MODELS:
            module.forward = _MODELS[type(module).__name__].__get__(module)
        family = _FAMILIES.get(type(module).__name__)
        if family is None:
            continue
        forward, model_slopes, heads_attr = family
        heads = int(getattr(module, heads_attr))
        if type(module).__name__ not in checked:
            got, want = model_slopes(module, heads), alibi_slopes(heads, MAX_BIAS)
            if got.shape != want.shape or not np.allclose(got, want, rtol=2e-5, atol=0):
                raise UnsupportedError(f"{type(module).__name__}: this transformers version computes ALiBi slopes "
                                       f"{got.tolist()[:4]}... for {heads} heads, not the standard ones llmc's kernels "
                                       f"use ({want.tolist()[:4]}...); use a transformers version whose slopes are "
                                       "the paper's")
            checked.add(type(module).__name__)
        module.forward = forward.__get__(module)
        count += 1
    return count
