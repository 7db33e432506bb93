"""Multi-head latent attention (DeepSeek-V3 and the models that copy its attention) traced as plain ops.

transformers' ``DeepseekV3Attention.expand_kv`` builds each head's key in a ``new_empty`` tensor filled by two
``copy_`` calls, which the ONNX exporter writes as ``ConstantOfShape`` (with the head count baked into a computed
shape) + ``Range`` + ``ScatterND``: ops the CUDA engine does not run, and a form the tensor-parallel pass cannot
split by heads. The same key is ``cat(k_nope, k_rot expanded over the heads)``: identical values, bit for bit
(both only move them), traced as ``Expand`` + ``Concat``. :func:`install` swaps that method on the instances while
tracing, for every attention module whose ``expand_kv`` is transformers' DeepSeek-V3 code (copies of it in other
families included; any other form is left alone).
"""

from __future__ import annotations


def _expand_kv(self, kv_nope, k_rot):
    """transformers' ``expand_kv`` with ``cat`` for ``new_empty`` + ``copy_``: (keys, values) ``[B, H, T, D]``."""
    import torch

    batch, _, tokens, _ = kv_nope.shape
    kv = self.kv_b_proj(kv_nope).view(batch, tokens, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
    k_nope, values = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
    return keys, values


def _reference_code():
    try:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    except ImportError:  # a transformers without DeepSeek-V3: nothing to replace
        return None
    return DeepseekV3Attention.expand_kv.__code__.co_code


def install(hf) -> int:
    """Replace ``expand_kv`` on the MLA attention modules of ``hf``. Returns how many were replaced."""
    code = _reference_code()
    count = 0
    for module in hf.modules():
        method = getattr(type(module), "expand_kv", None)
        if code is None or method is None or getattr(method, "__code__", None) is None:
            continue
        if method.__code__.co_code == code:  # transformers' code (or a verbatim copy), not another form
            module.expand_kv = _expand_kv.__get__(module)
            count += 1
    return count
