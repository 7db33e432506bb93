"""The TensorRT backend's lowering passes (:mod:`.lowering`): llmc's graph -> what TensorRT's ONNX parser maps to
native layers, over a per-sequence slot KV cache."""

from __future__ import annotations

from llmc.passes.tensorrt.lowering import lowering_passes

# For listing (``llmc build --print-passes``): the passes at the default engine profile.
LOWERING = tuple(lowering_passes(max_seq_len=4096))
