"""Quantization formats, algorithms, calibration and the graph pass that applies them."""
