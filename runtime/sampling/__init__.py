"""Choosing tokens: sampling parameters and the host (numpy) sampler (``sampler``), and structured outputs'
grammar-constrained token masks (``structured``). The CUDA engine's device sampler lives with its worker
(``llmc.runtime.workers.cuda.sampler``) and draws the same tokens."""
