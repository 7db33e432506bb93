"""The engine artifact format, as the runtime reads and checks it (no compiler imports).

An artifact is a directory: ``manifest.json``, the engine files, tokenizer and generation config,
``report.json`` and ``build_info.json``. The manifest lists a sha256 for every other file except
``build_info.json``, the one declared place for what differs between two builds of the same
inputs (timings, time of day, host). Everything else is deterministic: two builds of the same
inputs give byte-identical sealed files, hence the same :func:`artifact_digest`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from llmc import __version__
from llmc.errors import LlmcError

# 2: build timings moved from report.json to the unsealed build_info.json.
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MANIFEST = "manifest.json"
BUILD_INFO = "build_info.json"

# What the runtime needs on this machine to execute an engine of each backend. Each entry is
# (module to import, what it is, how to get it).
_BACKEND_MODULES = {
    "onnxruntime": (
        ("onnxruntime", "ONNX Runtime", "pip install onnxruntime"),
    ),
}
_REINSTALL = "reinstall llmc with a C++ compiler present (pip install --force-reinstall llmc)"
# ... and for each custom-op library an ONNX Runtime engine's graph may need (engine.custom_ops;
# engines that predate the field use the Python op). A "module:function" entry is called instead
# of imported: the native library is a plain shared object, found but never imported.
_CUSTOM_OPS_MODULES = {
    "llmc_ort_ops": (
        ("llmc.plugins.paged_attention.ort_native:library_path", "llmc's native PagedAttention custom-op library",
         _REINSTALL),
    ),
    "onnxruntime_extensions": (
        ("onnxruntime_extensions", "onnxruntime-extensions (hosts the PagedAttention Python op)",
         "pip install onnxruntime-extensions"),
        ("llmc.plugins.paged_attention._cpu", "llmc's C++ PagedAttention kernel", _REINSTALL),
    ),
}
# Engines for these backends run on an NVIDIA GPU under TensorRT, which this runtime cannot do yet.
_GPU_BACKENDS = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT for RTX"}


def sha256_file(path: Path) -> str:
    """``"sha256:<hex>"`` of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def artifact_digest(path: str | Path) -> str:
    """The artifact's identity: sha256 of ``manifest.json``, which lists the sha256 of every sealed file.

    Two builds of the same inputs have the same digest; ``build_info.json`` does not enter it.
    """
    return sha256_file(Path(path) / MANIFEST)


@dataclass
class Problem:
    """One reason an artifact cannot be trusted or run."""

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"


def _schema_problem(mpath: Path, manifest: dict) -> str | None:
    version = manifest.get("schema_version")
    if isinstance(version, int) and version > max(READABLE_SCHEMAS):
        return (f"{mpath}: schema_version {version} was written by a newer llmc "
                f"({manifest.get('llmc_version', 'unknown version')}); this llmc {__version__} reads schema "
                f"{max(READABLE_SCHEMAS)} or older: upgrade llmc (pip install -U llmc) to use this engine")
    if version not in READABLE_SCHEMAS:
        return (f"{mpath}: field 'schema_version' is {version!r}, this llmc reads "
                f"{', '.join(map(str, READABLE_SCHEMAS))}; rebuild the engine with this version of llmc")
    return None


def read_manifest(path: str | Path) -> dict:
    """Read and schema-check ``manifest.json`` of the artifact at ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise LlmcError(f"{root}: no such engine directory; build one with `llmc build CHECKPOINT -o {root}`")
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise LlmcError(f"{mpath}: missing; {root} is not an llmc engine (rebuild it with `llmc build`)")
    try:
        manifest = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LlmcError(f"{mpath}: not valid JSON ({exc}); the artifact is corrupt, rebuild it") from None
    if not isinstance(manifest, dict):
        raise LlmcError(f"{mpath}: not a JSON object; the artifact is corrupt, rebuild it")
    problem = _schema_problem(mpath, manifest)
    if problem:
        raise LlmcError(problem)
    return manifest


def _safe_member(name: str) -> bool:
    # A manifest is input too: it must not make verify read outside the artifact.
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name


def verify(path: str | Path) -> list[Problem]:
    """Check every file the manifest lists against its sha256, and look for unlisted files.

    ``build_info.json`` is the one file that is neither listed nor flagged: it holds the build's
    timings and host, which differ between builds of the same inputs (nothing loads it to run).
    """
    root = Path(path)
    manifest = read_manifest(root)
    problems = []
    listed = manifest.get("files", {})
    if not isinstance(listed, dict):
        return [Problem(MANIFEST, "field 'files' is not an object; the artifact is corrupt, rebuild it")]
    for name, digest in sorted(listed.items()):
        f = root / name
        if not _safe_member(name):
            problems.append(Problem(name, "listed in manifest.json with a path outside the artifact; refusing it"))
        elif f.is_symlink() or not f.is_file():
            problems.append(Problem(name, "missing (listed in manifest.json); rebuild the engine"))
        elif sha256_file(f) != digest:
            problems.append(Problem(name, "modified: its sha256 differs from manifest.json; rebuild the engine"))
    unsealed = {MANIFEST}
    if manifest.get("build_info") == BUILD_INFO:
        unsealed.add(BUILD_INFO)
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if (f.is_file() or f.is_symlink()) and rel not in unsealed and rel not in listed:
            problems.append(Problem(rel, "not listed in manifest.json; remove it or rebuild the engine"))
    return problems


def local_gpus() -> list[tuple[str, str]]:
    """``(name, compute capability)`` of each local NVIDIA GPU according to ``nvidia-smi`` (empty if none)."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [tuple(p.strip() for p in line.split(",", 1)) for line in out.splitlines() if "," in line]


def _gpu_problem(manifest: dict, backend: str, target: dict) -> str:
    """Everything this machine lacks to run a TensorRT / TensorRT-for-RTX engine, in one sentence."""
    engine = manifest.get("engine", {})
    version = (engine.get("builder", {}).get("version") or manifest.get("toolchain", {}).get(backend)
               or "the version it was built with")
    sm = target.get("sm") or engine.get("sm")
    product = _GPU_BACKENDS[backend]
    missing = []
    gpus = local_gpus()
    if not gpus:
        missing.append("no NVIDIA GPU (nvidia-smi finds none)")
    elif sm and not any(cc == sm for _, cc in gpus):
        missing.append("GPUs of another compute capability (" + ", ".join(f"{n}: {cc}" for n, cc in gpus) + ")")
    module = {"tensorrt": "tensorrt", "tensorrt_rtx": "tensorrt_rtx"}[backend]
    try:
        found = importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - not importable, whatever the reason
        missing.append(f"no {product} Python module ({module})")
    else:
        if found != version:
            missing.append(f"{product} {found}, not {version} (engines load only in the version that built them)")
    lacks = f"this machine has {'; '.join(missing)}; " if missing else ""
    # The GPU runtime (KV slots in device memory, execute_async_v3) is not part of this llmc yet.
    return (f"engine backend {backend!r} needs the GPU of target {target.get('name', '?')!r} (compute capability "
            f"{sm or 'of the target'}) with {product} {version}; {lacks}llmc {__version__}'s runtime executes only "
            "'onnxruntime' CPU engines so far; build with --target cpu to run here")


def cuda_problem(manifest: dict, device: str = "cuda") -> str | None:
    """Why this machine cannot run a CUDA engine on ``device`` (None: it can). Imports torch."""
    engine = manifest.get("engine", {})
    sm = engine.get("sm") or manifest.get("target", {}).get("sm")
    name = manifest.get("target", {}).get("name", "?")
    tp = int(manifest.get("parallel", {}).get("tensor", 1))
    need = f"engine backend 'cuda' is built for target {name!r} (compute capability {sm})" + (
        f" and runs on {tp} GPUs of it (tensor parallel, parallel.tensor = {tp})" if tp > 1 else "")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure to import means it cannot load
        return f"{need} and needs torch with CUDA, which does not import here ({type(exc).__name__}: {exc}); " \
               "fix: pip install torch"
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        gpus = local_gpus()
        found = ("; nvidia-smi lists " + ", ".join(f"{n} ({cc})" for n, cc in gpus) + " but torch "
                 f"{torch.__version__} cannot use it") if gpus else ": this machine has no NVIDIA GPU"
        return f"{need}{found}; run it on that GPU, or build with --target cpu to run here"
    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    cc = f"{major}.{minor}"
    if sm and cc != sm:
        return (f"{need}, but this GPU ({torch.cuda.get_device_name(index)}) has compute capability {cc}; "
                f"rebuild with --gpu auto on this machine")
    if torch.cuda.device_count() < tp:
        return f"{need}; this machine has {torch.cuda.device_count()}; run it where {tp} such GPUs are"
    from llmc.runtime.workers.cuda import kernels as cuda_kernels

    drv = cuda_kernels.driver_version()
    ptxas = manifest.get("toolchain", {}).get("ptxas_cuda", "unknown")
    if drv is not None and ptxas not in ("unknown", None):
        major = int(str(ptxas).split(".")[0])
        if drv[0] < major:
            return (f"{need}; its kernels were assembled by CUDA {ptxas}'s ptxas, and this driver supports CUDA "
                    f"{drv[0]}.{drv[1]}: upgrade the NVIDIA driver, or rebuild with an older Triton")
    return None


def load_problems(manifest: dict) -> list[Problem]:
    """Why this machine cannot run the engine described by ``manifest`` (empty: it can).

    Checks that the backend's runtime libraries and llmc's kernels import here, and that the KV
    layout is one this runtime implements. Imports them, so it costs what loading them costs.
    """
    from llmc.plugins.paged_attention import KV_LAYOUT

    engine = manifest.get("engine", {})
    backend = engine.get("backend")
    target = manifest.get("target", {})
    if backend in _GPU_BACKENDS:
        return [Problem(MANIFEST, _gpu_problem(manifest, backend, target))]
    if backend == "cuda":
        problem = cuda_problem(manifest)
        return [Problem(MANIFEST, problem)] if problem else []
    if backend not in _BACKEND_MODULES:
        return [Problem(MANIFEST, f"engine backend {backend!r} is unknown to llmc {__version__}; upgrade llmc or "
                                  "rebuild the engine with --target cpu")]
    problems = []
    custom_ops = engine.get("custom_ops", "onnxruntime_extensions")
    if custom_ops not in _CUSTOM_OPS_MODULES:
        return [Problem(MANIFEST, f"engine.custom_ops {custom_ops!r} is unknown to llmc {__version__}; upgrade llmc "
                                  "or rebuild the engine")]
    for module, what, fix in (*_BACKEND_MODULES[backend], *_CUSTOM_OPS_MODULES[custom_ops]):
        name, _, function = module.partition(":")
        try:
            loaded = importlib.import_module(name)
            if function:
                getattr(loaded, function)()
        except Exception as exc:  # noqa: BLE001 - any failure to import means it cannot load
            problems.append(Problem(MANIFEST, f"needs {what} ({name}), which does not load here "
                                              f"({type(exc).__name__}: {exc}); fix: {fix}"))
    layout = manifest.get("kv_cache", {}).get("layout")
    if layout != KV_LAYOUT:
        problems.append(Problem(MANIFEST, f"kv_cache layout {layout!r} is not implemented by this runtime (it "
                                          f"implements {KV_LAYOUT!r}); rebuild the engine with this llmc"))
    return problems


@dataclass
class Verification:
    """Everything `llmc verify` found. ``ok`` when the files are intact and this machine can load the engine."""

    engine: Path
    manifest: dict | None
    problems: list[Problem] = field(default_factory=list)
    load_problems: list[Problem] = field(default_factory=list)
    artifact_digest: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and not self.load_problems

    def to_json(self) -> dict:
        m = self.manifest or {}
        return {
            "ok": self.ok,
            "engine": str(self.engine),
            "schema_version": m.get("schema_version"),
            "llmc_version": m.get("llmc_version"),
            "target": m.get("target", {}).get("name"),
            "backend": m.get("engine", {}).get("backend"),
            "artifact_digest": self.artifact_digest,
            "problems": [str(p) for p in self.problems],
            "load_problems": [str(p) for p in self.load_problems],
        }


def check(path: str | Path, *, loadable: bool = True) -> Verification:
    """Integrity (every file's sha256, the schema version) and, with ``loadable``, whether this machine can run it.

    Raises :class:`LlmcError` only when ``path`` is not a directory; everything wrong with an
    artifact is returned as a :class:`Problem`.
    """
    root = Path(path)
    if not root.is_dir():
        raise LlmcError(f"{root}: no such engine directory; pass the folder that `llmc build -o` created")
    result = Verification(engine=root, manifest=None)
    try:
        result.manifest = read_manifest(root)
    except LlmcError as exc:
        message = str(exc)
        prefix = f"{root / MANIFEST}: "
        result.problems.append(Problem(MANIFEST, message[len(prefix):] if message.startswith(prefix) else message))
        return result
    result.problems = verify(root)
    result.artifact_digest = artifact_digest(root)
    if loadable:
        result.load_problems = load_problems(result.manifest)
    return result


def require_valid(path: str | Path) -> dict:
    """Read the manifest and raise :class:`LlmcError` naming the first bad file, if any."""
    manifest = read_manifest(path)
    problems = verify(path)
    if problems:
        raise LlmcError(f"{Path(path) / problems[0].file}: {problems[0].message}")
    return manifest
