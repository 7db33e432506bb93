"""Ahead-of-time kernels of a CUDA engine: cubins loaded and launched through the CUDA driver.

The build compiles every Triton kernel an engine launches to a cubin for the target SM (no GPU
needed) and records its launch metadata in the manifest (``engine.kernels``). Here they are
loaded with ``cuModuleLoadData`` and launched with ``cuLaunchKernel`` on torch's current stream,
so the launches are captured by CUDA graphs like any other work on that stream. No Triton, and
no JIT compilation, at run time. The driver is reached through ``ctypes`` (``libcuda.so.1``):
cuda-python would add a dependency for four calls.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

_CUDA: ctypes.CDLL | None = None
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def driver() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        _CUDA = ctypes.CDLL("libcuda.so.1")
    return _CUDA


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")


def driver_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, e.g. (13, 0); None when there is no driver."""
    try:
        cuda = driver()
    except OSError:
        return None
    v = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value // 1000, (v.value % 1000) // 10


@dataclass
class KernelInfo:
    """One kernel of ``engine.kernels``: the cubin file, its entry, and its launch rule."""

    name: str
    file: str
    sm: int
    num_warps: int
    shared_mem: int
    block_q: int
    num_kv_heads: int
    variant: str  # attention: "flash-prefill" / "flash-decode" / "flash-reduce", or the first kernel's "decode"
    #               (block_m 16) / "prefill" (block_m 64); "fused" otherwise
    key: str  # the configuration it serves (attention: session.attention_key; fused: the node's)
    config: dict = field(default_factory=dict)  # compile-time constants (tiles, splits) the launch rule uses

    @classmethod
    def from_manifest(cls, d: dict) -> KernelInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class LoadedKernel:
    """A cubin loaded into the current CUDA context."""

    def __init__(self, info: KernelInfo, cubin: bytes) -> None:
        cuda = driver()
        self.info = info
        self._module, self._fn = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(self._module), ctypes.c_char_p(cubin)),
               f"loading kernel {info.file} (cuModuleLoadData)")
        _check(cuda.cuModuleGetFunction(ctypes.byref(self._fn), self._module, info.name.encode()),
               f"cuModuleGetFunction({info.name})")
        if info.shared_mem > 48 * 1024:
            _check(cuda.cuFuncSetAttribute(self._fn, _MAX_DYNAMIC_SHARED, ctypes.c_int(info.shared_mem)),
                   "cuFuncSetAttribute")

    def launch(self, grid: tuple[int, int, int], args: list, stream: int) -> None:
        """``args``: tensors (passed as device pointers) and Python ints (int32), in the kernel's order."""
        holders = [ctypes.c_int32(a) if isinstance(a, int) else ctypes.c_uint64(a.data_ptr()) for a in args]
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        _check(driver().cuLaunchKernel(self._fn, *grid, self.info.num_warps * 32, 1, 1, self.info.shared_mem,
                                       ctypes.c_void_p(stream), params, None), f"launching {self.info.name}")


class InterpretedKernel:
    """A manifest kernel run by the Triton interpreter on CPU tensors, with the manifest's constexprs.

    Tests use it to drive the CUDA session's launch code (argument order, strides, grids) with no GPU;
    only the driver call differs from :class:`LoadedKernel`. Needs ``TRITON_INTERPRET=1``. Arguments are bound to
    the manifest's ``params`` by name (a kernel's absent optional pointers are constexpr None in its constexprs,
    between launch parameters). The interpreter's numpy has no bfloat16 and no hardware E4M3 conversion: kernels
    with those switches (the flash attention kernels' ``DOT_F32``, ``FP8_NATIVE``) run their portable paths.
    """

    def __init__(self, info: KernelInfo, entry: dict) -> None:
        import importlib

        self.info = info
        self._fn = getattr(importlib.import_module(entry["module"]), entry["fn"])
        self._config = dict(entry["config"])
        if "DOT_F32" in self._config:
            self._config.update(DOT_F32=True, PRECISION="ieee")
        if "FP8_NATIVE" in self._config:
            self._config["FP8_NATIVE"] = False
        self._params = list(entry.get("params", ()))

    def launch(self, grid: tuple[int, int, int], args: list, stream: int) -> None:
        del stream
        if self._params:
            bound = dict(zip(self._params, args, strict=True))
            self._fn[grid](**bound, **{k: v for k, v in self._config.items() if k not in bound})
        else:
            self._fn[grid](*args, **self._config)


class RecordedKernel:
    """A manifest kernel that only records its launches (``log``: (kernel name, grid) per launch); its outputs keep
    whatever they held. What a device step would launch, counted on the meta device
    (:mod:`llmc.runtime.workers.cuda.launches`)."""

    def __init__(self, info: KernelInfo, log: list) -> None:
        self.info = info
        self.log = log  # anything with append((name, grid))

    def launch(self, grid: tuple[int, int, int], args: list, stream: int) -> None:
        del args, stream
        self.log.append((self.info.name, tuple(grid)))


def load_kernels(root: Path, entries: list[dict], interpret: bool = False,
                 record: list | None = None) -> dict[tuple[str, str], object]:
    """Load every kernel of ``engine.kernels``, keyed by (key, variant). ``interpret``: the kernels the interpreter
    can run (those naming their module: the fused and the flash attention kernels) as :class:`InterpretedKernel`
    (the first attention kernel's configurations then run in torch); ``record``: every kernel as a
    :class:`RecordedKernel` logging into that list."""
    out = {}
    for d in entries:
        info = KernelInfo.from_manifest(d)
        if record is not None:
            out[(info.key, info.variant)] = RecordedKernel(info, record)
        elif interpret:
            if "module" in d:
                out[(info.key, info.variant)] = InterpretedKernel(info, d)
        else:
            out[(info.key, info.variant)] = LoadedKernel(info, (root / info.file).read_bytes())
    return out
