"""The table of targets: one row per device llmc can build for."""

from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import UnsupportedError


@dataclass(frozen=True)
class Target:
    """One build target. ``sm`` is the CUDA compute capability (None for the CPU)."""

    name: str
    description: str
    backend: str
    sm: str | None
    memory_gib: int | None
    native_formats: tuple[str, ...]
    available: bool


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("cpu", "x86-64 CPU, ONNX Runtime", "onnxruntime", None, None, ("fp32",), True),
        Target("a100", "NVIDIA A100", "tensorrt", "8.0", 80, ("fp16", "bf16", "int4"), False),
        Target("l40s", "NVIDIA L40S", "tensorrt", "8.9", 48, ("fp16", "bf16", "int4", "fp8"), False),
        Target("h100", "NVIDIA H100", "tensorrt", "9.0", 80, ("fp16", "bf16", "int4", "fp8"), False),
        Target("h200", "NVIDIA H200", "tensorrt", "9.0", 141, ("fp16", "bf16", "int4", "fp8"), False),
        Target("b200", "NVIDIA B200", "tensorrt", "10.0", 180, ("fp16", "bf16", "int4", "fp8", "nvfp4"), False),
        Target("rtx4090", "NVIDIA GeForce RTX 4090", "tensorrt_rtx", "8.9", 24, ("fp16", "bf16", "int4", "fp8"),
               False),
        Target("rtx5090", "NVIDIA GeForce RTX 5090", "tensorrt_rtx", "12.0", 32,
               ("fp16", "bf16", "int4", "fp8", "nvfp4"), False),
    ]
}


def get_target(name: str) -> Target:
    """Look a target up by name; unknown names and targets without a backend yet raise UnsupportedError."""
    target = TARGETS.get(name)
    if target is None:
        raise UnsupportedError(f"--target {name!r} is unknown; choose one of: {', '.join(TARGETS)}")
    if not target.available:
        raise UnsupportedError(
            f"--target {name!r} ({target.description}, backend {target.backend}) is not implemented in this "
            "version of llmc; build with --target cpu"
        )
    return target
