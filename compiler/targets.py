"""The table of targets: one row per device llmc can build for, and ``--gpu auto`` detection."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import UnsupportedError


@dataclass(frozen=True)
class Target:
    """One build target. ``sm`` is the CUDA compute capability (None for the CPU); ``memory_gib`` the
    device memory; ``native_formats`` the weight formats its tensor cores run without emulation;
    ``backend`` the builder (``onnxruntime``, ``tensorrt``, or ``tensorrt_rtx``: TensorRT for RTX, which
    builds ahead of time with no GPU present). ``aliases`` are substrings of ``nvidia-smi`` names."""

    name: str
    description: str
    backend: str
    sm: str | None
    memory_gib: int | None
    native_formats: tuple[str, ...]
    available: bool = True
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """How the CLI names this target: ``--gpu h100``, ``--target cpu``."""
        return f"--target {self.name}" if self.sm is None else f"--gpu {self.name}"


_AMPERE = ("fp16", "bf16", "int4")
_ADA_HOPPER = (*_AMPERE, "fp8")
_BLACKWELL = (*_ADA_HOPPER, "nvfp4")

TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("cpu", "x86-64 CPU, ONNX Runtime", "onnxruntime", None, None, ("fp32", "int4")),
        Target("a100", "NVIDIA A100", "tensorrt", "8.0", 80, _AMPERE, aliases=("A100",)),
        Target("l40s", "NVIDIA L40S", "tensorrt", "8.9", 48, _ADA_HOPPER, aliases=("L40S",)),
        Target("h100", "NVIDIA H100", "tensorrt", "9.0", 80, _ADA_HOPPER, aliases=("H100",)),
        Target("h200", "NVIDIA H200", "tensorrt", "9.0", 141, _ADA_HOPPER, aliases=("H200",)),
        Target("b200", "NVIDIA B200", "tensorrt", "10.0", 180, _BLACKWELL, aliases=("B200",)),
        Target("gb200", "NVIDIA GB200 (Grace Blackwell)", "tensorrt", "10.0", 186, _BLACKWELL, aliases=("GB200",)),
        Target("rtx4090", "NVIDIA GeForce RTX 4090", "tensorrt_rtx", "8.9", 24, _ADA_HOPPER, aliases=("RTX 4090",)),
        Target("rtx5090", "NVIDIA GeForce RTX 5090", "tensorrt_rtx", "12.0", 32, _BLACKWELL,
               aliases=("RTX 5090",)),
    ]
}
GPU_BACKENDS = ("tensorrt", "tensorrt_rtx")


def get_target(name: str) -> Target:
    """Look a target up by name; unknown names raise UnsupportedError listing the choices."""
    target = TARGETS.get(name)
    if target is None:
        gpus = ", ".join(n for n, t in TARGETS.items() if t.sm is not None)
        raise UnsupportedError(f"target {name!r} is unknown; choose --target cpu or --gpu one of: {gpus}, auto "
                               "(see `llmc targets`)")
    if not target.available:
        raise UnsupportedError(f"{target.flag} ({target.description}, backend {target.backend}) is not implemented "
                               "in this version of llmc; build with --target cpu")
    return target


def detect_gpu(gpus: list[tuple[str, str]] | None = None) -> Target:
    """The target of the local GPU (``--gpu auto``): the first ``nvidia-smi`` GPU whose name matches a row.

    ``gpus`` is ``[(name, compute capability)]`` (default: ask ``nvidia-smi``). Raises
    UnsupportedError naming what was found when no GPU, or no known GPU, is present.
    """
    if gpus is None:
        from llmc.compiler.backends.tensorrt import local_gpus

        gpus = local_gpus()
    if not gpus:
        raise UnsupportedError("--gpu auto: no NVIDIA GPU found on this machine (nvidia-smi is missing or lists "
                               "none); name the target instead, e.g. --gpu rtx4090, which TensorRT for RTX builds "
                               "without a GPU (see `llmc targets`), or build for --target cpu")
    for name, _cc in gpus:
        # Longest alias first: "GB200" must not match "B200".
        for alias, target in sorted(((a, t) for t in TARGETS.values() for a in t.aliases), key=lambda x: -len(x[0])):
            if alias.lower() in name.lower():
                return target
    found = ", ".join(f"{n} (compute capability {cc})" for n, cc in gpus)
    raise UnsupportedError(f"--gpu auto: this machine's GPU ({found}) is not in llmc's target table; name the "
                           "closest target with --gpu (see `llmc targets`)")
