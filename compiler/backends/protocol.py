"""What a backend is to the build: the :class:`Backend` protocol and the data it takes and gives back.

The build (compiler/build/) picks one backend per build from :mod:`llmc.compiler.backends.registry`, asks it to
refuse what it cannot build before any work, to name the tools whose versions key the cache, and finally to emit
the engine from the optimised graph and say what the manifest records of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class EmitJob:
    """One graph to emit. ``model`` is the optimised ``onnx_ir.Model`` (the backend may rewrite it in place);
    ``dest`` the artifact directory being written; ``quantized`` whether the accuracy report will score it (a GPU
    backend then keeps a copy of the graph for scoring on the CPU)."""

    model: Any
    dest: Path
    options: Any  # llmc.compiler.build.options.BuildOptions
    target: Any  # llmc.compiler.targets.Target
    config: dict  # the checkpoint's config.json
    say: Callable[[str], None]
    cache_root: Path | None = None
    quantized: bool = False
    fusions: frozenset[str] = frozenset()  # the backend fusions --disable-pass left on


@dataclass
class Emitted:
    """What a backend wrote. ``model_file`` / ``weights_file`` / ``custom_ops``: the ONNX files of an ONNX Runtime
    engine (None for the others); ``files``: the backend's own account of what it wrote, which its
    :meth:`Backend.manifest` reads; ``cpu_graph``: the quantized graph before the backend's lowering, for scoring on
    the CPU; ``info``: what goes to build_info.json."""

    fusions: dict[str, int] = field(default_factory=dict)
    model_file: str | None = None
    weights_file: str | None = None
    custom_ops: str | None = None
    files: Any = None
    cpu_graph: Any = None
    info: dict = field(default_factory=dict)


class Backend(Protocol):
    """One way to turn the optimised graph into an engine.

    ``name`` is what the manifest and the cache key call it; ``gpu`` whether it builds for a GPU (quantized weights
    then take the QDQ form and LoRA updates stay unfolded); ``runs_state`` whether its engines carry the recurrent
    state of hybrid layers; ``lowers_mxfp4`` whether it runs MXFP4 experts from their codes.
    """

    name: str
    gpu: bool
    runs_state: bool
    lowers_mxfp4: bool

    def handles(self, options, target) -> bool:
        """Whether this backend builds ``options`` for ``target`` (the registry asks in order)."""

    def check_request(self, options, target):
        """Refuse, before any work, what this backend cannot build (UnsupportedError, exit 3); returns the options
        as the build runs them (a backend may narrow the recipe, e.g. keep embeddings unquantized)."""

    def toolchain(self, target, options) -> dict[str, str]:
        """Versions of the backend's own tools, for the cache key."""

    def lowering_passes(self, options, fusions: frozenset[str]) -> list:
        """The backend's own graph rewrites (llmc.passes.base.GraphPass), in order, as emit runs them."""

    def emit(self, job: EmitJob) -> Emitted:
        """Write the engine's files into ``job.dest``."""

    def emit_graph(self, name: str, model, job: EmitJob) -> dict:
        """Write a further graph of the artifact (an encoder beside the language model) as ``name``'s files into
        ``job.dest`` (``job``: the language model's, whose target and options the graph follows); returns its
        manifest entry (backend, files, inputs, outputs)."""

    def manifest(self, fields: dict, emitted: Emitted, target) -> dict:
        """The manifest's sections for this engine, given the graph's own (``fields``: engine, kv_cache, target,
        toolchain as an ONNX Runtime engine of the same graph records them)."""
