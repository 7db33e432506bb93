"""Ahead-of-time PTX for the Triton PagedAttention kernel, on a machine with no GPU; the TensorRT plugin definition.

The PTX is checked for what TensorRT's AOT plugin launch needs: the entry Triton reports, the SM
asked for (``.target sm_XX``, ``a`` suffix on Hopper/Blackwell), exactly the documented parameters
(Triton's two hidden scratch pointers removed) with the int32 scalars where the contract puts them,
and that ``ptxas`` accepts the edited PTX for that SM.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

pytest.importorskip("triton", reason="triton is not installed: pip install '.[test]' (Linux wheels)")

from llmc.plugins.paged_attention import aot  # noqa: E402
from llmc.plugins.paged_attention.triton_kernel import KernelConfig  # noqa: E402

EXPECTED_TARGET = {80: "sm_80", 89: "sm_89", 90: "sm_90a", 100: "sm_100a"}


def _entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(rf"\.entry\s+{name}\s*\((.*?)\)", ptx, re.S)
    assert m, f"no .entry {name}"
    return [p.split()[1] for p in m.group(1).split(",") if p.strip()]  # .u64 / .u32


def _check(kernel, sm):
    assert kernel.sm == sm
    assert re.search(rf"^\.target\s+{EXPECTED_TARGET[sm]}\s*$", kernel.ptx, re.M), kernel.ptx[:400]
    assert kernel.target == EXPECTED_TARGET[sm]
    kinds = _entry_params(kernel.ptx, kernel.name)
    params = aot.SINKS_PARAMS if kernel.config.get("sinks") else aot.PARAMS
    assert kernel.params == params and len(kinds) == len(params) == 15 + bool(kernel.config.get("sinks"))
    scalars = [i for i, k in enumerate(kinds) if k == ".u32"]
    assert scalars == [params.index("num_seqs"), params.index("max_blocks")]
    assert kernel.num_warps == 4 and 0 < kernel.shared_mem <= 48 * 1024  # no opt-in to >48 KiB needed
    assert len(aot.assemble(kernel.ptx, sm)) > 1000


def test_ptx_for_every_sm_without_a_gpu():
    cfg = KernelConfig(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, scale=128**-0.5,
                       act_dtype="fp16", cache_dtype="fp16")
    kernels = aot.compile_ptx(cfg, (80, 89, 90, 100))
    for kernel, sm in zip(kernels, (80, 89, 90, 100), strict=True):
        _check(kernel, sm)
        assert kernel.grid(num_tokens=10, num_seqs=3) == (10 // cfg.block_q + 1 + 3, 8, 1)


def test_fp8_bf16_kernel_uses_hardware_conversion():
    """... with attention sinks too: their pointer follows kv_scales (aot.SINKS_PARAMS, what the CUDA engine passes)."""
    cfg = KernelConfig(num_heads=8, num_kv_heads=2, head_size=64, block_size=32, scale=0.125, act_dtype="bf16",
                       cache_dtype="u8", sliding_window=128, softcap=30.0, sinks=True)
    (kernel,) = aot.compile_ptx(cfg, (90,))
    _check(kernel, 90)
    assert aot.SINKS_PARAMS.index("sinks") == aot.PARAMS.index("kv_scales") + 1
    assert kernel.config["fp8_native"] and "cvt.rn.f16x2.e4m3x2" in kernel.ptx


def test_alibi_and_chunked_kernels_compile():
    """ALiBi (12 heads: slopes computed in the kernel from constexprs) and chunked local attention compile for sm_90
    with the plain parameter list (both are constexprs, no pointer)."""
    for extra in (dict(alibi_max_bias=8.0), dict(attention_chunk=8192, sliding_window=0)):
        cfg = KernelConfig(num_heads=12, num_kv_heads=4, head_size=64, block_size=16, scale=0.125, act_dtype="bf16",
                           cache_dtype="bf16", **extra)
        (kernel,) = aot.compile_ptx(cfg, (90,))
        _check(kernel, 90)
        assert kernel.params == aot.PARAMS


def test_refusals():
    cfg = KernelConfig(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, scale=0.125)
    with pytest.raises(ValueError, match="sm_70"):
        aot.compile_ptx(cfg, (70,))
    with pytest.raises(ValueError, match="num_splits"):
        aot.compile_ptx(KernelConfig(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, scale=0.1,
                                     num_splits=2), (90,))


def test_strip_refuses_used_hidden_params():
    ptx = ".entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n\tld.param.b64 %rd1, [k_param_1];\n}\n"
    with pytest.raises(RuntimeError, match="is used"):
        aot.strip_hidden_params(ptx, "k", 1)
    assert "k_param_1" not in aot.strip_hidden_params(ptx.replace("[k_param_1]", "[k_param_0]"), "k", 1)


TRT_PLUGIN_MISSING = importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("tensorrt.plugin") is None
NO_TRT_REASON = ("tensorrt.plugin is not importable: the TensorRT Python package (pip install 'tensorrt>=10.8', "
                 "with an NVIDIA driver) is not installed here")


def test_trt_plugin_module_imports_tensorrt_lazily():
    import sys

    from llmc.plugins.paged_attention import trt_plugin

    assert trt_plugin.PLUGIN_ID == "llmc::paged_attention"
    assert len(trt_plugin.INPUTS) == 10 and trt_plugin.INPUTS == aot.PARAMS[:10]
    assert trt_plugin.OUTPUTS == ("out", "k_cache_out", "v_cache_out") == aot.PARAMS[12:]
    if TRT_PLUGIN_MISSING:
        assert "tensorrt" not in sys.modules
        with pytest.raises(ImportError, match=r"pip install 'tensorrt>=10.8'"):
            trt_plugin.register(sm=90)


@pytest.mark.skipif(TRT_PLUGIN_MISSING, reason=NO_TRT_REASON)
def test_trt_plugin_registers_with_tensorrt():
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from llmc.plugins.paged_attention import trt_plugin

    trt_plugin.register(sm=90)
    trt_plugin.register(sm=90)  # idempotent
    assert hasattr(trtp.op.llmc, "paged_attention")
    cfg = trt_plugin.kernel_config(trt.float16, trt.uint8, (100, 8, 16, 128), num_heads=32, num_kv_heads=8,
                                   head_size=128, scale=0.088, sliding_window=0, softcap=0.0)
    assert cfg.fp8 and cfg.block_size == 16 and cfg.act_dtype == "fp16"
    with pytest.raises(RuntimeError, match="sm_90"):
        trt_plugin.register(sm=100)
