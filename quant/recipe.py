"""Quantization recipes: which format, which algorithm, which calibration data, and the checks that a
target can run them, made before any work."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from llmc.errors import LlmcError, UnsupportedError
from llmc.quant.int4 import GROUP_SIZES


@dataclass(frozen=True)
class Format:
    """One ``--quant`` choice. ``family`` is the tensor format (``fp8``, ``int4``, ``nvfp4``);
    ``algorithm`` how weights are rounded (``rtn``, ``awq``, ``gptq``); ``min_sm`` the oldest
    NVIDIA compute capability with kernels for it; ``cpu_native`` whether ONNX Runtime's CPU
    kernels run it (otherwise the CPU engine emulates it)."""

    name: str
    family: str
    algorithm: str
    min_sm: str
    cpu_native: bool
    description: str


FORMATS: dict[str, Format] = {f.name: f for f in [
    Format("fp8", "fp8", "rtn", "8.9", False,
           "FP8 E4M3 weights (per-output-channel scales) and activations (static per-tensor scales)"),
    Format("int4", "int4", "rtn", "8.0", True, "INT4 group-wise weights, round to nearest"),
    Format("int4-awq", "int4", "awq", "8.0", True, "INT4 group-wise weights, activation-aware scaling (AWQ)"),
    Format("int4-gptq", "int4", "gptq", "8.0", True, "INT4 group-wise weights, Hessian-based rounding (GPTQ)"),
    Format("nvfp4", "nvfp4", "rtn", "10.0", False,
           "NVFP4 weights and activations (E2M1, blocks of 16, E4M3 block scales, FP32 global scale)"),
]}
EMBEDDING_FORMATS = ("int8", "int4", "none")
LM_HEAD_FORMATS = ("int8", "int4", "none")
# CPU kernels for INT4 linears (QuantRecipe.int4_kernel).
INT4_KERNELS = ("llmc", "mlas")

# KV-cache format -> oldest compute capability that runs it. fp16 is stored natively everywhere: on the
# CPU the cache holds float16 (half the memory and the bytes each decode step reads, converted on read).
KV_CACHE_DTYPES = {"fp8": "8.9", "fp16": "8.0"}

# Which target to suggest when one cannot run a format, in order of preference.
_SUGGEST = {"fp8": ("h100", "l40s"), "nvfp4": ("b200", "rtx5090")}


@dataclass(frozen=True)
class QuantRecipe:
    """What to quantize and how. ``quant`` is a :data:`FORMATS` key or ``"none"``; ``kv_cache_dtype``
    ``"fp8"`` or None. Calibration: ``calib_data`` a file (None: the built-in pydoc text),
    ``calib_samples`` sequences of ``calib_seq_len`` tokens drawn with ``seed``. ``embeddings``: how INT4
    formats store the token-embedding table (``int8``, ``int4``: ONNX Runtime's ``GatherBlockQuantized``;
    ``none``: the compute dtype). ``lm_head``: how INT4 formats store the output projection (``int8``,
    the default, as llama.cpp and AWQ keep the output layer above 4 bits: it decides every sampled token,
    and its errors do not average out over layers; ``int4``; ``none``: the compute dtype).
    ``int4_accuracy_level`` is ``MatMulNBits``' compute mode on the
    CPU: 4 quantizes each activation block to int8 and uses integer dot products (ONNX Runtime's
    fastest CPU path, the default), 1 computes in fp32 (0: ONNX Runtime's default, fp32).
    ``int4_kernel``: which CPU kernel runs INT4 linears: ``llmc`` (llmc's ``Int4MatMul``, int8
    activations per group and integer dot products, laid out for AVX-512 VNNI / AVX2; the default) or
    ``mlas`` (ONNX Runtime's ``MatMulNBits`` at ``int4_accuracy_level``). ``eval_tokens``: held-out tokens
    the accuracy report scores (None: until its precision target, :class:`llmc.quant.evaluate.Precision`)."""

    quant: str = "none"
    group_size: int = 128
    symmetric: bool = False
    embeddings: str = "int8"
    lm_head: str = "int8"
    int4_accuracy_level: int = 4
    int4_kernel: str = "llmc"
    kv_cache_dtype: str | None = None
    calib_data: str | None = None
    # 32 x 256 tokens: on the default model, 64 -> 32 sequences moved int4-awq's / int4-gptq's held-out KL by
    # +0.8 % / +0.2 % and perplexity by < 0.01 %, 16 sequences KL by +4.8 % (quant_calibration_ab.json); the
    # forward and the Gram matrices, a third of a 1B layer's AWQ calibration, scale with it.
    calib_samples: int = 32
    calib_seq_len: int = 256
    seed: int = 0
    eval_tokens: int | None = None
    # Where calibration's forward and statistics run: "auto" (a CUDA device when torch sees one), "cpu", "cuda".
    # resolve_calib_device() makes it concrete before the recipe enters a cache key.
    calib_device: str = "auto"

    @property
    def format(self) -> Format | None:
        return FORMATS.get(self.quant)

    @property
    def enabled(self) -> bool:
        return self.quant != "none" or self.kv_cache_dtype is not None

    def needs_calibration(self) -> bool:
        """AWQ/GPTQ need activation statistics, FP8/NVFP4 activation scales and the FP8 KV cache need ranges."""
        fmt = self.format
        return self.kv_cache_dtype == "fp8" or (fmt is not None and (fmt.algorithm != "rtn" or fmt.family != "int4"))


def validate(recipe: QuantRecipe) -> None:
    """Raise :class:`LlmcError` for an unknown format or out-of-range option, naming the choices."""
    if recipe.quant != "none" and recipe.quant not in FORMATS:
        raise LlmcError(f"--quant {recipe.quant!r}: unknown format; choose one of: none, {', '.join(FORMATS)}")
    if recipe.kv_cache_dtype is not None and recipe.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise LlmcError(f"--kv-cache-dtype {recipe.kv_cache_dtype!r}: unknown; choose one of: "
                        f"{', '.join(KV_CACHE_DTYPES)} (or leave it out for the model dtype)")
    if recipe.group_size not in GROUP_SIZES:
        raise LlmcError(f"--group-size {recipe.group_size}: choose one of {', '.join(map(str, GROUP_SIZES))}")
    if recipe.embeddings not in EMBEDDING_FORMATS:
        raise LlmcError(f"embeddings {recipe.embeddings!r}: choose one of {', '.join(EMBEDDING_FORMATS)}")
    if recipe.lm_head not in LM_HEAD_FORMATS:
        raise LlmcError(f"--lm-head {recipe.lm_head!r}: choose one of {', '.join(LM_HEAD_FORMATS)}")
    if recipe.int4_kernel not in INT4_KERNELS:
        raise LlmcError(f"--int4-kernel {recipe.int4_kernel!r}: choose one of {', '.join(INT4_KERNELS)} (llmc: "
                        "llmc's INT4 kernel, the default; mlas: ONNX Runtime's MatMulNBits)")
    if recipe.int4_accuracy_level not in (0, 1, 2, 3, 4):
        raise LlmcError(f"--int4-accuracy-level {recipe.int4_accuracy_level}: choose 0-4 (1: fp32 compute, "
                        "4: int8 compute)")
    if recipe.calib_data is not None and not Path(recipe.calib_data).is_file():
        raise LlmcError(f"--calib-data {recipe.calib_data}: no such file; pass a plain-text or JSONL file (or omit "
                        "it for the built-in calibration text)")
    if recipe.calib_samples < 1:
        raise LlmcError(f"--calib-samples {recipe.calib_samples}: must be at least 1")
    if recipe.calib_seq_len < 8:
        raise LlmcError(f"--calib-seq-len {recipe.calib_seq_len}: must be at least 8 tokens")
    if recipe.calib_device not in CALIB_DEVICES:
        raise LlmcError(f"--calib-device {recipe.calib_device!r}: choose one of {', '.join(CALIB_DEVICES)}")


CALIB_DEVICES = ("auto", "cpu", "cuda")


def resolve_calib_device(recipe: QuantRecipe) -> QuantRecipe:
    """The recipe with ``calib_device`` concrete: ``"cpu"`` when nothing calibrates; ``"auto"`` becomes ``"cuda"``
    where torch sees a CUDA device, else ``"cpu"``. Raises :class:`LlmcError` for ``"cuda"`` without one."""
    if not recipe.needs_calibration():
        return replace(recipe, calib_device="cpu")
    if recipe.calib_device == "cpu":
        return recipe
    import torch

    if torch.cuda.is_available():
        return replace(recipe, calib_device="cuda")
    if recipe.calib_device == "cuda":
        raise LlmcError("--calib-device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                        "use --calib-device cpu, or auto to take a GPU only where there is one")
    return replace(recipe, calib_device="cpu")


def _sm(value: str) -> tuple[int, int]:
    major, minor = value.split(".")
    return int(major), int(minor)


def _sm_name(value: str) -> str:
    return "sm_" + value.replace(".", "")


def check_target(recipe: QuantRecipe, target_name: str, targets: dict) -> list[str]:
    """Refuse, before any work, a recipe the target cannot run natively; return warnings for CPU emulation.

    ``targets`` is the target table (name -> row with ``sm``, None for the CPU). An unknown target
    name passes here (the target lookup reports it).
    """
    target = targets.get(target_name)
    if target is None:
        return []
    fmt = recipe.format
    if target.sm is None:  # the CPU: INT4 runs on MatMulNBits, the rest is emulated
        warnings = []
        if fmt is not None and not fmt.cpu_native:
            warnings.append(
                f"--quant {fmt.name}: ONNX Runtime has no CPU kernels for {fmt.family.upper()}; the CPU engine "
                "emulates it (weights stored quantized and decoded for the matmul, activations quantized and "
                "dequantized), so it measures the format's accuracy, not its speed")
        if recipe.kv_cache_dtype == "fp8":
            warnings.append(
                f"--kv-cache-dtype {recipe.kv_cache_dtype}: emulated on the CPU (K/V are rounded to FP8 with "
                "per-layer scales before they enter the cache, which stays in the compute dtype)")
        return warnings
    checks = []
    if fmt is not None:
        checks.append((f"--quant {fmt.name}", fmt.min_sm, fmt.family))
    if recipe.kv_cache_dtype is not None:
        checks.append((f"--kv-cache-dtype {recipe.kv_cache_dtype}", KV_CACHE_DTYPES[recipe.kv_cache_dtype], "kv"))
    for flag, need, family in checks:
        if _sm(target.sm) >= _sm(need):
            continue
        fixes = []
        if family == "nvfp4" and _sm(target.sm) >= _sm(FORMATS["fp8"].min_sm):
            fixes.append(f"--quant fp8 ({_sm_name(FORMATS['fp8'].min_sm)}+) on this target")
        elif family in ("nvfp4", "fp8"):
            fixes.append(f"--quant int4 ({_sm_name(FORMATS['int4'].min_sm)}+) on this target")
        elif family == "kv":
            fixes.append("no --kv-cache-dtype (KV cache in the model dtype) on this target")
        able = [n for n in _SUGGEST.get("nvfp4" if family == "nvfp4" else "fp8", ())
                if n in targets and _sm(targets[n].sm) >= _sm(need)]
        if able:  # GPU targets are named with --gpu
            fixes.append(f"a {_sm_name(need)}+ target such as --gpu {' / '.join(able)}")
        raise UnsupportedError(
            f"{flag} needs compute capability {need} ({_sm_name(need)}) or newer, but --gpu {target_name} "
            f"({getattr(target, 'description', target_name)}) is {_sm_name(target.sm)}; use {' or '.join(fixes)}")
    return []


def canonical(recipe: QuantRecipe) -> str | dict:
    """The recipe as it enters the manifest and the build-cache key: ``"none"``, or every field with
    the calibration file replaced by its content digest (the same text under another name is the
    same recipe; edited text is not)."""
    if not recipe.enabled:
        return "none"
    out = asdict(recipe)
    if recipe.calib_data is not None:
        path = Path(recipe.calib_data)
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        out["calib_data"] = f"sha256:{digest}"
    return out


def summary(canonical_recipe: str | dict) -> str:
    """Short text of a canonical recipe: ``none``, ``int4-awq/g128``, ``fp8+kv:fp8``."""
    if isinstance(canonical_recipe, str):
        return canonical_recipe
    text = canonical_recipe["quant"]
    if FORMATS.get(text) is not None and FORMATS[text].family == "int4":
        text += f"/g{canonical_recipe['group_size']}"
    if canonical_recipe.get("kv_cache_dtype"):
        text += f"+kv:{canonical_recipe['kv_cache_dtype']}"
    return text
