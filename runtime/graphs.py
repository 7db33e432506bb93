"""The further graphs of an artifact (an encoder beside the language model): found in the manifest's ``graphs``,
each loaded as its own ONNX Runtime session, or, in a CUDA engine's artifact, as its own torch program on the
engine's device (llmc.runtime.workers.cuda.graph_program). The language model is the manifest's ``engine``; this
module never touches it.

The files of every graph are sealed in the same manifest as the language model's (one ``llmc verify``), and the
build that made them had one cache key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError


def graph_entries(manifest: dict) -> dict[str, dict]:
    """``name -> entry`` (backend, model_file, weights_file, inputs, outputs) of every further graph; empty for an
    artifact that holds the language model only."""
    return dict(manifest.get("graphs") or {})


@dataclass
class GraphSession:
    """One further graph, ready to run: ``run(feeds)`` takes ``{input name: array}`` and returns the outputs in
    the manifest's order."""

    name: str
    inputs: list[str]
    outputs: list[str]
    session: object  # onnxruntime.InferenceSession, or a CudaGraphProgram (the same run(outputs, feeds))

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise LlmcError(f"graph {self.name!r}: missing inputs {missing}; it takes {self.inputs}")
        return self.session.run(self.outputs, {n: feeds[n] for n in self.inputs})


def load_graph(artifact_dir: str | Path, manifest: dict, name: str, threads: int | None = None,
               device: str | None = None) -> GraphSession:
    """Open graph ``name`` of the artifact at ``artifact_dir`` (whose manifest is ``manifest``). ``threads``: ONNX
    Runtime's intra-op threads; ``device``: where a CUDA graph runs (default: the GPU if torch sees one)."""
    entries = graph_entries(manifest)
    if name not in entries:
        have = ", ".join(sorted(entries)) or "none"
        raise LlmcError(f"{artifact_dir}: the artifact holds no graph {name!r} (its further graphs: {have})")
    entry = entries[name]
    if entry["backend"] == "cuda":
        from llmc.runtime.workers.cuda.graph_program import CudaGraphProgram

        program = CudaGraphProgram(Path(artifact_dir), entry, device)
        return GraphSession(name, list(entry["inputs"]), list(entry["outputs"]), program)
    if entry["backend"] != "onnxruntime":
        raise LlmcError(f"{artifact_dir}: graph {name!r} is a {entry['backend']} graph; this runtime loads "
                        "onnxruntime and cuda graphs")
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(Path(artifact_dir) / entry["model_file"]), options,
                                   providers=["CPUExecutionProvider"])
    return GraphSession(name, list(entry["inputs"]), list(entry["outputs"]), session)
