"""llama4's text model on packed tokens: chunked local attention, NoPE layers with temperature tuning,
interleaved (complex) rotary without complex tensors, and its router without a scatter.

transformers' llama4 computes its rotary factors as a complex tensor (``torch.polar``) that its attention multiplies
with queries and keys viewed as complex numbers; the ONNX exporter has no complex tensors. Its chunked layers take
their chunk from a mask llmc's attention never sees, and its NoPE layers scale queries by a function of positions
they compute from the cache length. So, on the instances, while tracing:

- ``Llama4TextRotaryEmbedding.forward`` returns ``[..., D/2, 2]`` real (cos, sin) pairs, the very products
  transformers' complex numbers hold (``polar(1, f) * attention_scaling``), and keeps the step's positions for
  the attention modules;
- ``Llama4TextAttention.forward`` rotates (x_even, x_odd) pairs as the complex product does
  (``(a + bi)(c + di) = (ac - bd) + (ad + bc)i``, float32), applies the weightless Q/K norm and, on NoPE layers,
  the temperature tuning ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` at each token's own position
  (transformers' ``arange + past_seen_tokens`` for one sequence), then calls llmc's paged attention
  (``attention_hook.attention``) with ``attention_chunk`` = ``attention_chunk_size`` on the layers whose type is
  ``chunked_attention`` (the rest attend globally, as transformers' causal mask);
- ``Llama4Router.forward`` keeps transformers' scores, ``sigmoid`` of the top-k logits and 0 elsewhere
  (``sigmoid(-inf)``), selecting with a comparison instead of ``full_like(-inf).scatter_`` (ops the CUDA engine
  does not run); the same values, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Step:
    """The traced positions ``[1, T]`` of the step, set by the rotary forward, read by the NoPE layers."""

    positions: object = None


def _rotary_forward(self, x, position_ids):
    """(cos, sin) ``[1, T, D/2, 2]`` float32: transformers' ``polar(1, p * inv_freq) * attention_scaling`` as pairs."""
    import torch

    self.llmc_step.positions = position_ids
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((torch.cos(freqs) * self.attention_scaling, torch.sin(freqs) * self.attention_scaling), -1)


def _rotate(x, pairs):
    """``x`` ``[1, T, H, D]`` times the factors ``pairs`` ``[1, T, D/2, 2]`` as complex numbers of (even, odd)
    components, in float32, back in ``x``'s dtype (transformers' ``apply_rotary_emb``)."""
    import torch

    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    c, d = pairs[:, :, None, :, 0], pairs[:, :, None, :, 1]
    return torch.stack((a * c - b * d, a * d + b * c), -1).flatten(3).type_as(x)


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """Llama4TextAttention.forward on packed tokens through llmc's attention (see the module docstring)."""
    import torch

    from llmc.compiler.attention_hook import attention

    input_shape = hidden_states.shape[:-1]
    query = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    key = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    if self.use_rope:
        query, key = _rotate(query, position_embeddings), _rotate(key, position_embeddings)
    if hasattr(self, "qk_norm"):
        query, key = self.qk_norm(query), self.qk_norm(key)
    if self.attn_temperature_tuning and not self.use_rope:
        positions = self.llmc_step.positions[0]  # [T]: each token's own position in its sequence
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        query = (query * scales.view(1, -1, 1, 1)).to(query.dtype)
    chunk = 0
    if self.config.layer_types[self.layer_idx] == "chunked_attention":
        chunk = int(self.config.attention_chunk_size)
    kwargs.pop("attention_chunk", None)
    out, _ = attention(self, query.transpose(1, 2), key.transpose(1, 2), value, None, scaling=self.scaling,
                        attention_chunk=chunk, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


def _router_forward(self, hidden_states):
    """Llama4Router.forward: (scores [T, E], logits [T, E]); scores are sigmoid(logit) on each token's top-k experts
    (torch.topk's choice, ties included), 0 on the others."""
    import torch

    logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
    _, top = torch.topk(logits, self.top_k, dim=1)
    experts = torch.arange(logits.shape[1], device=logits.device)
    chosen = (top[:, :, None] == experts).sum(1) > 0  # [T, E]
    scores = torch.sigmoid(logits.float()).to(logits.dtype)
    return torch.where(chosen, scores, torch.zeros((), dtype=scores.dtype)), logits


def install(hf) -> int:
    """Replace the rotary and attention forwards of a llama4 text model ``hf`` by llmc's. Returns how many attention
    modules were replaced (0 for other models)."""
    step = _Step()
    count = 0
    for module in hf.modules():
        name = type(module).__name__
        if name == "Llama4TextRotaryEmbedding":
            module.llmc_step = step
            module.forward = _rotary_forward.__get__(module)
        elif name == "Llama4Router":
            module.forward = _router_forward.__get__(module)
        elif name == "Llama4TextAttention":
            module.llmc_step = step
            module.forward = _attention_forward.__get__(module)
            count += 1
    return count
