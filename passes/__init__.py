"""Graph-to-graph rewrites on ``onnx_ir.Model``. A pass never imports a backend."""
