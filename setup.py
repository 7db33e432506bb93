"""Builds the C++ core (CPU paged-attention kernel and its ONNX Runtime custom-op library, KV block
manager, the read-bandwidth probe of `llmc bench`, calibration's Gram kernel) as part of `pip install`.

Metadata lives in pyproject.toml; only the extension needs code.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import Extension, setup

_PA = "plugins/paged_attention/csrc"
# The plugins whose ONNX Runtime op is plugins/<name>/csrc/ort_<name>.cpp, one translation unit each.
_ORT_OPS = ("paged_attention", "int4_matmul", "recurrent", "lora", "mxfp4", "bf16_matmul")
# Portable builds: kernels for newer instruction sets are chosen at run time (target attributes, CPU checks).
_OPENMP = {"extra_compile_args": ["-O3", "-fopenmp", "-march=x86-64-v2", "-Wno-psabi"], "extra_link_args": ["-fopenmp"]}

ext_modules = [
    Pybind11Extension(
        "llmc.plugins.paged_attention._cpu",
        [f"{_PA}/paged_attention_cpu.cpp"],
        depends=[f"{_PA}/paged_attention_core.h", "plugins/csrc/parallel_for.h", "plugins/csrc/exp_nonpos.h",
                 "plugins/csrc/isa.h"],
        cxx_std=17,
        **_OPENMP,
    ),
    # Not a Python module: a plain shared library that ONNX Runtime loads as a custom-op library
    # (SessionOptions.register_custom_ops_library) and the runtime binds the KV pool and recurrent state of through
    # ctypes (llmc.plugins.paged_attention.ort_native). One registration unit (plugins/csrc/ort_ops.cpp) and the
    # shared helpers; each plugin's op from its own folder. It uses only ONNX Runtime's C ABI
    # (plugins/csrc/ort_abi.h), found at run time through the OrtApiBase the runtime passes in: nothing to link.
    Extension(
        "llmc.plugins._ort_ops",
        ["plugins/csrc/ort_ops.cpp", "plugins/csrc/ort_kernel.cpp",
         *(f"plugins/{name}/csrc/ort_{name}.cpp" for name in _ORT_OPS)],
        depends=[*(f"plugins/csrc/{h}.h" for h in ("ort_abi", "ort_kernel", "ort_ops", "isa", "parallel_for",
                                                   "exp_nonpos")),
                 f"{_PA}/paged_attention_core.h", "plugins/int4_matmul/csrc/int4_matmul_core.h",
                 "plugins/recurrent/csrc/recurrent_core.h", "plugins/mxfp4/csrc/mxfp4_core.h",
                 "plugins/mxfp4/csrc/mxfp4_q8_core.h", "plugins/mxfp4/csrc/moe_epilogue.h",
                 "plugins/bf16_matmul/csrc/bf16_matmul_core.h"],
        language="c++",
        extra_compile_args=["-std=c++17", "-O3", "-fopenmp", "-march=x86-64-v2", "-fvisibility=hidden", "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
    ),
    Pybind11Extension("llmc.runtime._membench", ["runtime/csrc/membench.cpp"], cxx_std=17, **_OPENMP),
    # Calibration's float32 Gram matrices of bfloat16 activations (AVX-512 BF16, dispatched at run time).
    Pybind11Extension("llmc.quant._gram", ["quant/csrc/gram_bf16.cpp"], cxx_std=17, **_OPENMP),
    Pybind11Extension(
        "llmc.runtime._block_manager",
        ["runtime/csrc/block_manager.cpp"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

setup(ext_modules=ext_modules)
