"""Loading an artifact into the parts an ``Engine`` runs: one loader per executor (``ort``: ONNX Runtime CPU
engines; ``cuda``: the CUDA engine, which imports torch only when called), and what they share (``common``)."""
