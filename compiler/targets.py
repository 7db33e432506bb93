"""The table of targets: one row per device llmc can build for, and ``--gpu auto`` detection."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import UnsupportedError


@dataclass(frozen=True)
class Target:
    """One build target. ``sm`` is the CUDA compute capability (None for the CPU); ``memory_gib`` the
    device memory; ``native_formats`` the weight formats its tensor cores run without emulation;
    ``backend`` the builder (``onnxruntime``, ``tensorrt``, or ``tensorrt_rtx``: TensorRT for RTX, which
    builds ahead of time with no GPU present). ``aliases`` are substrings of ``nvidia-smi`` names.
    ``memory_bandwidth_gbps``: the datasheet's device-memory bandwidth in GB/s (1e9 B/s; the SXM part where
    there are several); ``interconnect_gbps``: GPU-to-GPU bandwidth in GB/s, both directions together (NVLink,
    or PCIe for cards without it). ``llmc plan`` uses both."""

    name: str
    description: str
    backend: str
    sm: str | None
    memory_gib: int | None
    native_formats: tuple[str, ...]
    available: bool = True
    aliases: tuple[str, ...] = ()
    memory_bandwidth_gbps: int | None = None
    interconnect_gbps: int | None = None

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
        Target("a100", "NVIDIA A100", "tensorrt", "8.0", 80, _AMPERE, aliases=("A100",),
               memory_bandwidth_gbps=2039, interconnect_gbps=600),
        Target("l40s", "NVIDIA L40S", "tensorrt", "8.9", 48, _ADA_HOPPER, aliases=("L40S",),
               memory_bandwidth_gbps=864, interconnect_gbps=64),
        Target("h100", "NVIDIA H100", "tensorrt", "9.0", 80, _ADA_HOPPER, aliases=("H100",),
               memory_bandwidth_gbps=3350, interconnect_gbps=900),
        Target("h200", "NVIDIA H200", "tensorrt", "9.0", 141, _ADA_HOPPER, aliases=("H200",),
               memory_bandwidth_gbps=4800, interconnect_gbps=900),
        Target("b200", "NVIDIA B200", "tensorrt", "10.0", 180, _BLACKWELL, aliases=("B200",),
               memory_bandwidth_gbps=8000, interconnect_gbps=1800),
        Target("gb200", "NVIDIA GB200 (Grace Blackwell)", "tensorrt", "10.0", 186, _BLACKWELL, aliases=("GB200",),
               memory_bandwidth_gbps=8000, interconnect_gbps=1800),
        Target("rtx4090", "NVIDIA GeForce RTX 4090", "tensorrt_rtx", "8.9", 24, _ADA_HOPPER, aliases=("RTX 4090",),
               memory_bandwidth_gbps=1008, interconnect_gbps=64),
        Target("rtx5090", "NVIDIA GeForce RTX 5090", "tensorrt_rtx", "12.0", 32, _BLACKWELL,
               aliases=("RTX 5090",), memory_bandwidth_gbps=1792, interconnect_gbps=128),
    ]
}
# Bandwidths: NVIDIA datasheets (A100 80GB SXM, H100 SXM, H200 SXM, HGX B200, GB200 NVL72); L40S and the RTX
# cards have no NVLink: their interconnect is PCIe (Gen4 x16: 64 GB/s, Gen5 x16: 128 GB/s, both directions).
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
