"""``llmc build``: checkpoint → traced graph → passes → backend → sealed artifact.

:func:`build` always compiles. :func:`build_cached` (what the CLI runs) first looks the build up
in the content-addressed store (:mod:`llmc.build_cache`) and compiles only on a miss. Both run the same
:func:`prepare` (load + check) and the same :data:`llmc.compiler.build.stages.STAGES`.

Output directories are written into a temporary sibling directory and renamed into place only
when complete, so a failed or interrupted build never leaves a partial output directory.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import llmc
from llmc.build_cache import KeyInputs, Store, sources_digest
from llmc.compiler import artifact
from llmc.compiler.build.checks import CHECKS
from llmc.compiler.build.faults import kill_point
from llmc.compiler.build.options import BuildOptions, BuildResult, canonical_recipe, recipe_summary
from llmc.compiler.build.plan import Plan, make_plan
from llmc.compiler.build.publish import CorruptEntry, export, publish
from llmc.compiler.build.self_check import package_root
from llmc.compiler.build.stages import STAGES
from llmc.compiler.build.state import BuildState
from llmc.compiler.checkpoint import Checkpoint, load_checkpoint
from llmc.errors import EXIT_OUT_OF_MEMORY, LlmcError
from llmc.runtime import artifact as runtime_artifact

# The tracing, pass and backend modules import torch / onnx / onnx_ir (seconds of start-up), so
# they are imported only when something is compiled: a cache hit never needs them.

Progress = Callable[[str], None]


def prepare(checkpoint_dir: str | Path, plan: Plan, say: Progress, timings: dict[str, float],
            t0: float) -> tuple[Checkpoint, str]:
    """Stages load and check: read the checkpoint (config, tensor index; weights stay on disk) and refuse or narrow
    what it rules out (llmc.compiler.build.checks). Returns the checkpoint and its content digest."""
    say("[1/5] load checkpoint")
    ckpt = load_checkpoint(checkpoint_dir)
    for check in CHECKS:
        check(ckpt, plan)
    digest = ckpt.digest()
    timings["load"] = time.perf_counter() - t0
    return ckpt, digest


def compile_into(ckpt: Checkpoint, digest: str, plan: Plan, dest: Path, say: Progress, timings: dict[str, float],
                 t0: float, info: dict | None = None) -> BuildState:
    """The compile stages into the existing empty ``dest``, under the memory guard: past ``--max-memory``, or with
    the machine about to run out, the build stops with one line (exit 5) instead of dying to the kernel's OOM
    killer; peak resident memory per stage goes to build_info.json."""
    from llmc import memory

    peaks = memory.StagePeaks()
    guard = memory.Guard(plan.options.max_memory, lambda: peaks.current or "the build",
                         exit_code=EXIT_OUT_OF_MEMORY, on_abort=lambda: shutil.rmtree(dest, ignore_errors=True))
    state = BuildState(ckpt, digest, plan, dest, say, timings, t0, peaks, build, info=dict(info or {}))
    try:
        with guard:
            try:
                for stage in STAGES:
                    stage.run(state)
            except BaseException:
                if state.pending is not None:
                    state.pending.cancel()
                raise
    except memory.MemoryExceeded as exc:
        raise LlmcError(f"{exc}; no engine was written. {_memory_fix(plan.options.max_memory, plan.memory)}",
                        exit_code=EXIT_OUT_OF_MEMORY) from None
    return state


def _memory_fix(limit: int | None, estimate=None) -> str:
    need = f" (llmc's estimate for this build: {estimate.need / (1 << 30):.1f} GB)" if estimate is not None else ""
    if limit is not None:
        return f"Raise --max-memory{need}, or leave it out to use what the machine has"
    return (f"Free memory (other processes) or build where more is available{need}; --max-memory N sizes the "
            "build's rounds to N")


def _check_pass_names(plan: Plan) -> None:
    from llmc.compiler.pipeline import passes_for

    options = plan.options
    passes_for(plan.target.name, options.disabled_passes, options.extra_passes)  # bad pass names: fail now


def build(checkpoint_dir: str | Path, out_dir: str | Path, options: BuildOptions | None = None,
          progress: Progress | None = None) -> BuildResult:
    """Build an engine for ``options.target`` from the checkpoint into ``out_dir`` (no build cache).

    Raises :class:`LlmcError` for bad input before any output exists.
    """
    options = options or BuildOptions()
    say = progress or (lambda msg: None)
    plan = make_plan(out_dir, options)
    out = plan.out
    _check_pass_names(plan)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ckpt, digest = prepare(checkpoint_dir, plan, say, timings, t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        state = compile_into(ckpt, digest, plan, tmp, say, timings, t0)
        build_info = json.loads((tmp / runtime_artifact.BUILD_INFO).read_text())
        digest_out = runtime_artifact.artifact_digest(tmp)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildResult(out_dir=out, manifest=state.manifest, report=state.report, timings=timings,
                       build_info=build_info, artifact_digest=digest_out)


def cache_key_inputs(ckpt_digest: str, plan: Plan) -> KeyInputs:
    """What the cache key of building a checkpoint with content digest ``ckpt_digest`` by ``plan`` covers."""
    backend = plan.backend
    return KeyInputs(
        checkpoint_digest=ckpt_digest,
        recipe=canonical_recipe(plan.options),
        target={"name": plan.target.name, "sm": plan.target.sm,
                "backend": "cuda" if backend.name == "cuda" else plan.target.backend},
        toolchain={**artifact.toolchain_versions(), **backend.toolchain(plan.target, plan.options)},
        llmc_version=llmc.__version__,
        sources_digest=sources_digest(package_root()),
    )


def _open_store(cache_dir, key: str, plan: Plan) -> Store:
    store = Store(cache_dir)
    plan.cache_root = store.root
    try:
        store.locks_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LlmcError(f"{store.root}: build cache directory is not writable ({exc.strerror}); pass --cache-dir "
                        "or set LLMC_CACHE_DIR to a writable directory") from None
    return store


def _copy_hit(store: Store, entry, key: str, plan: Plan, say: Progress, timings: dict[str, float]):
    """Copy a cache hit to -o; a damaged entry is evicted (returns None: rebuild)."""
    t = time.perf_counter()
    try:
        export(entry.artifact, plan.out)
    except CorruptEntry as exc:
        # A warning, not progress: it shows under --json too (stderr), where progress lines do not.
        logging.getLogger("llmc").warning("cache entry %s is damaged (%s); evicting it and rebuilding", key[:16], exc)
        store.remove_locked(key)
        return None
    store.touch(entry)
    timings["copy"] = time.perf_counter() - t
    say(f"      cache hit {key[:16]}: copied {entry.artifact} -> {plan.out}")
    return entry


def _compile_into_store(store: Store, key: str, inputs: KeyInputs, ckpt: Checkpoint, digest: str, plan: Plan,
                        say: Progress, timings: dict[str, float], t0: float, refresh: bool):
    say(f"      cache {'refresh' if refresh else 'miss'} {key[:16]}: building")
    with store.staging(key) as staged:
        dest = staged / "artifact"
        dest.mkdir()
        compile_into(ckpt, digest, plan, dest, say, timings, t0, info={"cache_key": key})
        kill_point("before-publish")
        meta = {
            "key_inputs": asdict(inputs),
            "model": {"model_type": ckpt.model_type, "name": ckpt.path.resolve().name, "dtype": ckpt.dtype},
            "target": plan.target.name,
            "recipe_summary": recipe_summary(inputs.recipe),
            "artifact_digest": runtime_artifact.artifact_digest(dest),
        }
        entry = store.publish(key, staged, meta)
    kill_point("after-publish")
    t = time.perf_counter()
    try:
        export(entry.artifact, plan.out)
    except CorruptEntry as exc:  # we just built and sealed it: a bug, not bad input
        raise RuntimeError(f"freshly built cache entry {key} fails verification: {exc}") from None
    timings["copy"] = time.perf_counter() - t


def build_cached(checkpoint_dir: str | Path, out_dir: str | Path, options: BuildOptions | None = None,
                 progress: Progress | None = None, *, cache_dir: str | Path | None = None,
                 refresh: bool = False) -> BuildResult:
    """:func:`build` through the build cache at ``cache_dir`` (default: see :func:`llmc.build_cache.default_root`).

    On a hit the stored artifact is copied to ``out_dir`` (and checked against its manifest on
    the way; a damaged entry is evicted and rebuilt). On a miss, or with ``refresh``
    (``--no-cache``), the engine is compiled into the store, published atomically, then copied.
    Concurrent calls for one key compile once: the others wait for the first and reuse its entry.

    The key needs the checkpoint's content digest, so every call reads the checkpoint files once
    (a miss reads the weights a second time while emitting, mostly from the page cache).
    Builds with ``extra_passes`` or ``extra_graphs`` (what the key cannot capture) bypass the cache.
    """
    options = options or BuildOptions()
    if options.extra_passes or options.extra_graphs:
        return build(checkpoint_dir, out_dir, options, progress)
    say = progress or (lambda msg: None)
    plan = make_plan(out_dir, options)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ckpt, digest = prepare(checkpoint_dir, plan, say, timings, t0)
    t = time.perf_counter()
    inputs = cache_key_inputs(digest, plan)
    key = inputs.key()
    store = _open_store(cache_dir, key, plan)
    timings["key"] = time.perf_counter() - t
    with store.lock(key, on_wait=lambda: say(f"      waiting for another llmc build of {key[:16]} to finish")):
        entry = None if refresh else store.get(key)
        if entry is not None:
            entry = _copy_hit(store, entry, key, plan, say, timings)
        hit = entry is not None
        if entry is None:
            _compile_into_store(store, key, inputs, ckpt, digest, plan, say, timings, t0, refresh)
    timings["total"] = time.perf_counter() - t0
    out = plan.out
    return BuildResult(
        out_dir=out,
        manifest=runtime_artifact.read_manifest(out),
        report=json.loads((out / "report.json").read_text()),
        timings=timings,
        build_info=json.loads((out / runtime_artifact.BUILD_INFO).read_text()),
        cache_hit=hit,
        key=key,
        artifact_digest=runtime_artifact.artifact_digest(out),
    )
