"""The plan of one build: the options as the build runs them, the target and the backend that builds it, all
checked before any checkpoint is read (:func:`make_plan`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from llmc.compiler.backends.protocol import Backend
from llmc.compiler.backends.registry import CudaBackend, backend_for
from llmc.compiler.build.options import BuildOptions, validate
from llmc.compiler.targets import TARGETS, Target, get_target
from llmc.compiler.versions import check_transformers
from llmc.errors import LlmcError, UnsupportedError
from llmc.quant import recipe as quant_recipe


@dataclass
class Plan:
    out: Path
    options: BuildOptions
    target: Target
    backend: Backend
    # Where GPU builders keep their timing caches (the build cache's root; see build_cached).
    cache_root: Path | None = None
    # The build's memory estimate (compiler.memory_plan.Estimate) and, under --max-memory, the accuracy report's
    # round size in tokens.
    memory: object | None = None
    round_tokens: int | None = None

    def rechoose(self, options: BuildOptions) -> None:
        """Take ``options`` (a stage narrowed the recipe) and check them with the backend again."""
        self.options = self.backend.check_request(options, self.target)


def uses_cuda_engine(options: BuildOptions, target: Target) -> bool:
    """Whether this build writes llmc's CUDA engine (every GPU target, unless --engine tensorrt)."""
    return isinstance(backend_for(options, target), CudaBackend)


def make_plan(out_dir: str | Path, options: BuildOptions) -> Plan:
    """Every check on options and output that needs no checkpoint, before any work."""
    out = Path(out_dir)
    check_transformers()  # the engine follows transformers' classes: only the versions CI runs, before any work
    validate(options)
    quant_recipe.check_target(options.quant, options.target, TARGETS)  # before get_target: name the constraint
    # A concrete calibration device before the recipe enters the cache key: GPU and CPU statistics differ in
    # their rounding, so their weights may too.
    options = replace(options, quant=quant_recipe.resolve_calib_device(options.quant))
    target = get_target(options.target)
    backend = backend_for(options, target)
    if options.tp > 1 and backend.name != "cuda":
        raise UnsupportedError(f"--tp {options.tp} with {target.flag}: tensor parallelism splits llmc's CUDA engine "
                               "over GPUs; build for a GPU (--gpu h100 ...) or without --tp")
    if options.tp > 1 and options.lora_slots:
        raise UnsupportedError(f"--tp {options.tp} with --lora-slots: LoRA slots are not split across ranks yet; "
                               "build one of them")
    options = backend.check_request(options, target)
    if out.exists() and not options.force:
        raise LlmcError(f"{out}: output directory already exists; pass --force to replace it or choose another -o")
    if out.exists() and not out.is_dir():
        raise LlmcError(f"{out}: exists and is not a directory; choose another -o")
    return Plan(out, options, target, backend)
