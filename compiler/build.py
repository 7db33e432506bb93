"""``llmc build``: checkpoint → traced graph → passes → backend → sealed artifact.

The artifact is written into a temporary sibling directory and renamed into place only when
complete, so a failed or interrupted build never leaves a partial output directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmc.compiler import artifact
from llmc.compiler.backends import onnxruntime as ort_backend
from llmc.compiler.checkpoint import load_checkpoint
from llmc.compiler.frontend import GRAPH_INPUTS, GRAPH_OUTPUTS, trace
from llmc.compiler.pipeline import passes_for, run_pipeline
from llmc.compiler.targets import get_target
from llmc.errors import LlmcError
from llmc.plugins.paged_attention import KV_LAYOUT

Progress = Callable[[str], None]


@dataclass
class BuildOptions:
    """What to build. ``block_size`` is the KV-cache block size in tokens."""

    target: str = "cpu"
    block_size: int = 16
    force: bool = False
    disabled_passes: tuple[str, ...] = ()
    verify_passes: bool = False
    # Python API only: passes appended to the pipeline (tests use this to plant a broken pass).
    extra_passes: tuple = ()


@dataclass
class BuildResult:
    out_dir: Path
    manifest: dict
    report: dict
    timings: dict[str, float] = field(default_factory=dict)


def _validate(options: BuildOptions) -> None:
    if options.block_size < 1 or options.block_size > 1024 or options.block_size & (options.block_size - 1):
        raise LlmcError(f"--block-size {options.block_size}: must be a power of two from 1 to 1024 (default 16)")


def build(checkpoint_dir: str | Path, out_dir: str | Path, options: BuildOptions | None = None,
          progress: Progress | None = None) -> BuildResult:
    """Build an engine for ``options.target`` from the checkpoint into ``out_dir``.

    Raises :class:`LlmcError` for bad input before any output exists.
    """
    options = options or BuildOptions()
    say = progress or (lambda msg: None)
    out = Path(out_dir)
    _validate(options)
    target = get_target(options.target)
    passes = passes_for(target.name, options.disabled_passes, options.extra_passes)
    if out.exists() and not options.force:
        raise LlmcError(f"{out}: output directory already exists; pass --force to replace it or choose another -o")
    if out.exists() and not out.is_dir():
        raise LlmcError(f"{out}: exists and is not a directory; choose another -o")

    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def stage(name: str, n: int) -> None:
        say(f"[{n}/5] {name}")

    stage("load checkpoint", 1)
    ckpt = load_checkpoint(checkpoint_dir)
    digest = ckpt.digest()
    timings["load"] = time.perf_counter() - t0

    stage("trace with torch.export", 2)
    t = time.perf_counter()
    traced = trace(ckpt, compute_dtype="float32")
    timings["trace"] = time.perf_counter() - t
    nodes_traced = sum(1 for _ in traced.model.graph)

    stage(f"optimise graph ({len(passes)} passes{', verified' if options.verify_passes else ''})", 3)
    t = time.perf_counter()
    verifier = None
    if options.verify_passes:
        from llmc.compiler.verify import KVShape, PassVerifier

        verifier = PassVerifier(traced.model, traced.vocab_size,
                                KVShape(traced.num_layers, traced.num_kv_heads, traced.head_size,
                                        options.block_size))
    pass_stats = run_pipeline(traced.model, passes, verify=verifier, progress=lambda name: say(f"      {name}"))
    if verifier is not None:
        for entry in pass_stats:
            entry["verified_rel_error"] = verifier.errors.get(entry["pass"])
    timings["passes"] = time.perf_counter() - t

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        stage(f"emit {target.backend} engine (streaming weights)", 4)
        t = time.perf_counter()
        files = ort_backend.emit(traced.model, tmp)
        timings["emit"] = time.perf_counter() - t

        stage("write artifact", 5)
        artifact.copy_tokenizer(ckpt.path, tmp)
        timings["total"] = time.perf_counter() - t0
        report = {
            "passes": pass_stats,
            "graph": {"nodes_traced": nodes_traced, "nodes_final": sum(1 for _ in traced.model.graph)},
            "timings_s": {k: round(v, 3) for k, v in timings.items()},
        }
        artifact.write_json(tmp / "report.json", report)
        manifest = artifact.seal(
            tmp,
            {
                "source": {"model_type": ckpt.model_type, "digest": digest, "dtype": ckpt.dtype},
                "recipe": {"quant": "none", "compute_dtype": traced.compute_dtype,
                           "passes": [p.name for p in passes]},
                "target": {"name": target.name, "backend": target.backend},
                "toolchain": artifact.toolchain_versions(),
                "engine": {
                    "backend": target.backend,
                    "model_file": files.model,
                    "weights_file": files.weights,
                    "inputs": list(GRAPH_INPUTS),
                    "outputs": list(GRAPH_OUTPUTS),
                    "vocab_size": traced.vocab_size,
                },
                "kv_cache": {
                    "layout": KV_LAYOUT,
                    "block_size": options.block_size,
                    "dtype": traced.compute_dtype,
                    "num_layers": traced.num_layers,
                    "num_kv_heads": traced.num_kv_heads,
                    "head_size": traced.head_size,
                    "num_heads": traced.num_heads,
                },
            },
        )
        os.chmod(tmp, 0o755)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out_dir=out, manifest=manifest, report=report, timings=timings)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished build into place; an existing output (with --force) is replaced only now."""
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, out)
