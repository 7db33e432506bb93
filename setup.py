"""Builds the C++ core (CPU paged-attention kernel, KV block manager) as part of `pip install`.

Metadata lives in pyproject.toml; only the extension needs code.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "llmc.plugins.paged_attention._cpu",
        ["plugins/paged_attention/csrc/paged_attention_cpu.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3", "-fopenmp", "-march=x86-64-v2"],
        extra_link_args=["-fopenmp"],
    ),
    Pybind11Extension(
        "llmc.runtime._block_manager",
        ["runtime/csrc/block_manager.cpp"],
        cxx_std=17,
        extra_compile_args=["-O2"],
    ),
]

setup(ext_modules=ext_modules)
