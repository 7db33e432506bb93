#!/usr/bin/env python3
"""Run onnxruntime_genai.models.builder with one fix applied.

Bug (onnxruntime-genai 0.18.0, builders/base.py Model.has_lm_head): any
torch.nn.Linear whose out_features == vocab_size is taken for the LM head.
In our 1b model intermediate_size == vocab_size == 8192, so every layer's
gate_proj/up_proj is "read as LM head" (33 times in all) and the exported graph
wires /lm_head/MatMul to layer 0's post-attention RMSNorm output instead of the
final norm: logits are wrong (max |diff| vs HF ~5, while all hidden states up to
the final norm match to 1e-5), and layer 15's MLP + final norm are dead code.
Fix: when the HF model has a .lm_head module, only that module is the LM head.
Same command-line arguments as `python -m onnxruntime_genai.models.builder`.
"""
import os
import runpy
import sys

import onnxruntime_genai.models as _m
import torch

# builder.py does `from builders import ...` with its own folder on sys.path, so
# patch that module object (not onnxruntime_genai.models.builders.base).
sys.path.insert(0, os.path.dirname(_m.__file__))
import builders.base as base  # noqa: E402

_orig = base.Model.has_lm_head


def has_lm_head(self, module):
    lm = getattr(self.weights, "lm_head", None)
    if isinstance(lm, torch.nn.Module):
        return module is lm
    return _orig(self, module)


base.Model.has_lm_head = has_lm_head
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
