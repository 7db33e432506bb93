"""Position embeddings that do not take the traced step's ``positions`` as transformers passes them.

llmc's traced step hands the model each token's 0-based position in its sequence as ``position_ids``. Two kinds
of learned or fixed position tables read something else, so the trace would embed wrong positions:

* **Cache-length tables** (mbart, plbart, mvp, trocr, pegasus, whisper, bart): the decoder computes
  ``arange(T) + cache_length`` itself and never reads ``position_ids``; with no cache in the trace every step
  would start at position 0. Their ``embed_positions`` (an ``nn.Embedding`` whose ``forward`` takes
  ``cache_length``) is replaced, on the instance, by a lookup of row ``position + offset`` (``offset`` is 2 in the
  fairseq-derived families, absent otherwise), which is what transformers computes with a cache.
* **RoBERTa-style embeddings** (roberta, xlm-roberta, camembert, data2vec-text, ...): without ``position_ids``
  (how the model is defined, after fairseq) position ``n`` reads row ``padding_idx + 1 + n``, and padding tokens
  do not count; the step's 0-based ids are shifted by ``padding_idx + 1``. Exact for sequences without the padding
  token (a padding token inside a prompt shifts transformers' later positions by one, which a step cannot see).
  transformers' own ``generate`` passes 0-based ids to these models (its generic default), unlike their forward.

``install(hf)`` patches the modules found; the step's positions come from :data:`STEP`, set by the frontend's
traced wrapper around the model call.
"""

from __future__ import annotations

import inspect
import types

# The traced step's [T] positions, set by the frontend's wrapper around the model call (cleared after it).
STEP: dict = {}


def _cache_length_table(module) -> bool:
    import torch

    if not isinstance(module, torch.nn.Embedding):
        return False
    return "cache_length" in inspect.signature(module.forward).parameters


def _roberta_style(module) -> bool:
    return (callable(getattr(module, "create_position_ids_from_input_ids", None))
            and isinstance(getattr(module, "padding_idx", None), int)
            and "position_ids" in inspect.signature(module.forward).parameters)


def _table_forward(original):
    def forward(self, *args, **kwargs):
        import torch

        # transformers' tables return [T, D] or [1, T, D] (by family): its own call gives the shape (its wrong rows
        # are dead in the graph).
        shape = original(*args, **kwargs).shape
        rows = STEP["positions"] + int(getattr(self, "offset", 0) or 0)
        return torch.nn.functional.embedding(rows, self.weight).reshape(shape)

    return forward


def _roberta_forward(original):
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["position_ids"] = STEP["positions"][None] + self.padding_idx + 1
        return original(*bound.args, **bound.kwargs)

    return forward


def install(hf) -> list[str]:
    """Patch ``hf``'s position tables that would not read the step's positions; the patched module names."""
    patched = []
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] == "embed_positions" and _cache_length_table(module):
            module.forward = types.MethodType(_table_forward(module.forward), module)
            patched.append(name)
        elif _roberta_style(module):
            module.forward = types.MethodType(_roberta_forward(module.forward), module)
            patched.append(name)
    return patched
