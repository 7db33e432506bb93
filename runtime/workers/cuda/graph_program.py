"""A further graph of a CUDA engine's artifact (its vision encoder): the graph's own program
(``{name}/program.json`` + ``weights.safetensors``, written by ``llmc.compiler.backends.cuda.emit_graph``) run with
torch on the language model's device, its ops' AOT kernels (LayerNorm, GELU, ...: manifest ``graphs.{name}.kernels``)
launched through the driver on a GPU. On the CPU the same program runs on torch's CPU ops (how CI holds it to
transformers), or with ``interpret_kernels`` its kernels under the Triton interpreter.

It has no KV cache and no CUDA graphs: it runs once per image, at a size that follows the image.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from llmc.runtime.workers.cuda import kernels as cuda_kernels
from llmc.runtime.workers.cuda.fused_ops import FusedOps
from llmc.runtime.workers.cuda.ops import DTYPES
from llmc.runtime.workers.cuda.program import FORMAT, VERSION, Program, load_weights


def _no_attention(*_args, **_kwargs):
    raise ValueError("a further graph's program has no paged attention (it holds no KV cache)")


class CudaGraphProgram:
    """``run(output_names, feeds)`` as an ONNX Runtime session's: ``{input name: array}`` in, arrays out (float
    outputs as float32)."""

    def __init__(self, root: Path, entry: dict, device: str | torch.device | None = None,
                 interpret_kernels: bool = False) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = root / entry["program_file"]
        spec = json.loads(path.read_text())
        if spec.get("format") != FORMAT or spec.get("version") != VERSION:
            raise ValueError(f"{path}: not an {FORMAT} version {VERSION} file")
        self.dtype = DTYPES[spec["dtype"]]
        self.input_names = list(spec["inputs"])
        on_gpu = self.device.type == "cuda"
        entries = entry.get("kernels") or []
        kernels = cuda_kernels.load_kernels(root, entries) if on_gpu else \
            cuda_kernels.load_kernels(root, entries, interpret=True) if interpret_kernels else {}
        self.kernels = kernels
        fused = FusedOps(lambda key: kernels.get((key, "fused")) if key else None, self._launch, self.dtype,
                         self.device) if kernels else None
        self.program = Program(spec, load_weights(path.parent, spec, self.device), _no_attention,
                               fused.overrides() if fused is not None else None)

    def _launch(self, kernel, grid, args) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        kernel.launch(grid, args, stream)

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        del output_names  # the program's outputs, in the manifest's order
        tensors = {n: torch.from_numpy(np.ascontiguousarray(feeds[n])).to(self.device) for n in self.input_names}
        with torch.inference_mode():
            outs = self.program.run(tensors)
        return [(o.float() if o.is_floating_point() else o).cpu().numpy() for o in outs]
