"""Shared fixtures: tiny checkpoints and engines, built once per test session (shared across xdist workers)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from filelock import FileLock

# Triton kernels run in the interpreter on this CPU-only suite. Triton fixes the mode of its own
# library functions when it is first imported, so this must precede any import of triton (a
# GPU check runs in its own process: scripts/gpu_check.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
# xdist workers share the cores: ORT threads that spin would steal them from each other (see
# runtime/workers/ort/spin_policy.py, tested on its own in test_spin_policy.py).
os.environ.setdefault("LLMC_ORT_SPIN", "0")
# The same for torch's (and the C++ kernels') OpenMP pools, in the workers and every process they start: with
# two workers on two cores, a tiny model's transformers.generate ran 40x slower with two OpenMP threads than
# with one (3.5 vs 0.09 s for the usual 3 prompts x 32 tokens), its threads waiting on each other's barriers.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Builds skip the architecture self-check (compiler/selfcheck.py) unless a test turns it on: each distinct
# configuration and option set would build a twin; tests/test_selfcheck.py tests the check itself.
os.environ.setdefault("LLMC_SELF_CHECK", "0")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "assets" / "default-model"


@pytest.fixture(autouse=True, scope="session")
def _private_build_cache(tmp_path_factory):
    """Builds through the CLI cache into a per-run directory, never the user's ~/.cache/llmc."""
    os.environ["LLMC_CACHE_DIR"] = str(tmp_path_factory.mktemp("llmc-cache"))


def _shared_dir(tmp_path_factory) -> Path:
    # With xdist every worker has its own basetemp; their parent is common to the run.
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    shared = root / "llmc-shared"
    shared.mkdir(exist_ok=True)
    return shared


def _once(tmp_path_factory, name: str, make) -> Path:
    shared = _shared_dir(tmp_path_factory)
    target = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        if not (target / ".done").exists():
            make(target)
            (target / ".done").touch()
    return target


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from llmc.testing.checkpoints import write_tiny_llama

    return _once(tmp_path_factory, "tiny-llama-fp32", lambda p: write_tiny_llama(p, seed=0))


@pytest.fixture(scope="session")
def tiny_llama_bf16(tmp_path_factory) -> Path:
    from llmc.testing.checkpoints import write_tiny_llama

    return _once(tmp_path_factory, "tiny-llama-bf16", lambda p: write_tiny_llama(p, dtype="bfloat16", seed=1))


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory) -> Path:
    from llmc.testing.checkpoints import write_tiny_llama

    return _once(tmp_path_factory, "tiny-llama-sharded",
                 lambda p: write_tiny_llama(p, seed=2, max_shard_size="100KB"))


def _engine(tmp_path_factory, name: str, checkpoint: Path) -> Path:
    from llmc.compiler.build import BuildOptions, build

    def make(target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        # Every test build checks each pass differentially (graph before vs after, fresh random inputs).
        build(checkpoint, target / "engine", BuildOptions(verify_passes=True))

    return _once(tmp_path_factory, name, make) / "engine"


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_llama) -> Path:
    return _engine(tmp_path_factory, "engine-tiny-fp32", tiny_llama)


@pytest.fixture(scope="session")
def tiny_engine_bf16(tmp_path_factory, tiny_llama_bf16) -> Path:
    return _engine(tmp_path_factory, "engine-tiny-bf16", tiny_llama_bf16)


@pytest.fixture(scope="session")
def default_engine(tmp_path_factory) -> Path:
    return _engine(tmp_path_factory, "engine-default", DEFAULT_MODEL)


def _built(tmp_path_factory, name: str, checkpoint: Path, **options) -> Path:
    """``checkpoint`` built once per session with exactly ``options`` (no pass verification): for tests in
    several files that each built the same engine with the same options and only read it."""
    from llmc.compiler.build import BuildOptions, build

    def make(target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        build(checkpoint, target / "engine", BuildOptions(**options))

    return _once(tmp_path_factory, name, make) / "engine"


@pytest.fixture(scope="session")
def tiny_engine_plain(tmp_path_factory, tiny_llama) -> Path:
    """The tiny checkpoint's CPU engine with the default options (``llmc build`` as a user runs it)."""
    return _built(tmp_path_factory, "engine-tiny-plain", tiny_llama)


@pytest.fixture(scope="session")
def tiny_cuda_engine(tmp_path_factory, tiny_llama) -> Path:
    """The tiny checkpoint's CUDA engine for an H100 in float32, its AOT kernels compiled."""
    return _built(tmp_path_factory, "engine-tiny-cuda-fp32", tiny_llama, target="h100", dtype="float32")


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """``family_checkpoint(model_type) -> checkpoint``: a tiny random checkpoint of that family, written once."""
    from llmc.testing.checkpoints import write_tiny_model

    def get(model_type: str) -> Path:
        return _once(tmp_path_factory, f"family-{model_type}", lambda p: write_tiny_model(model_type, p, seed=3))

    return get


@pytest.fixture(scope="session")
def family_build(tmp_path_factory, family_checkpoint):
    """``family_build(model_type) -> (checkpoint, engine)``: a tiny random checkpoint of that family and
    its CPU engine, built once per test session."""

    def get(model_type: str) -> tuple[Path, Path]:
        ckpt = family_checkpoint(model_type)
        return ckpt, _engine(tmp_path_factory, f"engine-family-{model_type}", ckpt)

    return get


@pytest.fixture(scope="session")
def family_cuda_engine(tmp_path_factory, family_checkpoint):
    """``family_cuda_engine(model_type) -> engine``: that family's tiny checkpoint as a CUDA engine for an H100 in
    float32 without its AOT kernels (they play no part on the CPU), built once per session
    (tests/test_cuda_engine.py holds it to transformers; tests/test_tensor_parallel.py uses it as the tp=1 engine)."""

    def get(model_type: str) -> Path:
        return _built(tmp_path_factory, f"engine-family-cuda-{model_type}", family_checkpoint(model_type),
                      target="h100", dtype="float32", aot_kernels=False)

    return get


@pytest.fixture(scope="session")
def vlm_checked_image_build(tmp_path_factory):
    """``vlm_checked_image_build(model_type) -> root``: the tiny vision-language checkpoint of that family (seed 5)
    with its image processor in ``root / "ckpt"``, built with the default options (its vision encoder too) and the
    architecture self-check on, into a cache of its own, in ``root / "engine"``; once per session
    (tests/test_vlm_text.py reads its check, tests/test_vlm_qwen_images.py runs the engine)."""

    def get(model_type: str) -> Path:
        def make(target: Path) -> None:
            from llmc.compiler.build import BuildOptions, build
            from llmc.testing.vlm import write_processor, write_tiny_vlm

            write_tiny_vlm(model_type, target / "ckpt", seed=5)
            write_processor(model_type, target / "ckpt")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LLMC_SELF_CHECK", "1")
                mp.setenv("LLMC_CACHE_DIR", str(target / "cache"))
                build(target / "ckpt", target / "engine", BuildOptions())

        return _once(tmp_path_factory, f"vlm-checked-{model_type}", make)

    return get


def same_checkpoint(a: Path, b: Path) -> bool:
    """Whether two checkpoint directories hold the same config and weights, byte for byte."""
    names = ("config.json", "model.safetensors")
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)

# xdist's default ("load") hands tests out in chunks, so a module's tests often land on both workers: each worker
# then sets up the module's module-scoped fixtures (a build, a server, a Ray instance) again, or waits idle on the
# other's lock for a session fixture the module shares across workers (tests/test_build_cache.py's cached build);
# 9 modules were split so in one run. xdist's loadgroup cannot keep them together here (it tags Item._nodeid, which
# pytest 9 no longer reads). This scheduler keeps each test module that defines a module-, class- or session-scoped
# fixture on one worker and hands out every other test one at a time; the modules go first (most tests first), the
# single tests fill in behind them. With --dist load (xdist's default) only; any other --dist is xdist's own.
_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](?:module|class|session)["']""")


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped: dict[str, bool] = {}

    def has_shared_fixture(module: str) -> bool:
        if module not in grouped:
            path = Path(config.rootpath) / module
            grouped[module] = path.suffix == ".py" and path.is_file() and bool(_SHARED_SCOPE.search(path.read_text()))
        return grouped[module]

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if has_shared_fixture(module) else nodeid

    return ModuleFixtureScheduling(config, log)
