"""``llmc::paged_attention``: the PagedAttention op as a TensorRT plugin (``tensorrt.plugin``, AOT).

The plugin's kernel is the Triton kernel of :mod:`.triton_kernel`, compiled ahead of time to PTX
for the target SM by :mod:`.aot` and embedded in the engine, so the engine runs with no Python
at run time (and under ``trtexec``). Importing this module needs nothing; :func:`register` imports
``tensorrt.plugin`` and raises ``ImportError`` saying what to install when it is missing.

Plugin contract (what a TensorRT backend lowers each ``llmc.PagedAttention`` node to):

- ONNX node: ``op_type="paged_attention"``, attributes ``plugin_namespace="llmc"`` and
  ``aot=1`` (TensorRT's ONNX parser then uses the AOT implementation), plus the op's attributes
  ``num_heads num_kv_heads head_size scale sliding_window softcap layer_idx``.
- inputs, in order: the op's seven (``query key value slot_mapping block_tables context_lens
  query_start_loc``; metadata int64), then ``k_cache``, ``v_cache`` (this layer's cache,
  ``[num_blocks, num_kv_heads, block_size, head_size]``, engine inputs bound to the runtime's pool;
  the activation dtype, or ``UINT8``/``FP8`` for an FP8 cache) and ``kv_scales`` (float32 ``[2]``,
  ``[k_scale, v_scale]``; a constant, ``[1, 1]`` when the cache is not FP8).
- outputs: ``out`` ``[T, num_heads * head_size]`` (query's dtype), and ``k_cache``/``v_cache``
  aliased to the cache inputs (the new K/V rows are written in place).

``block_size`` comes from ``k_cache``'s static shape. One PTX per (dtype, cache format, shape
attributes, SM); a single launch (no split-KV: see docs/gpu.md).
"""

# No ``from __future__ import annotations`` here: tensorrt.plugin validates the decorated functions'
# annotations as live classes (issubclass), and requires the aot_impl's return annotation.

from llmc.plugins.paged_attention import aot

PLUGIN_NAMESPACE = "llmc"
PLUGIN_NAME = "paged_attention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
INPUTS = ("query", "key", "value", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
          "k_cache", "v_cache", "kv_scales")
OUTPUTS = ("out", "k_cache_out", "v_cache_out")
ATTRIBUTES = ("num_heads", "num_kv_heads", "head_size", "scale", "sliding_window", "softcap", "layer_idx")

_registered_sm: int | None = None


def _import_trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise ImportError(
            f"tensorrt.plugin is not importable ({exc}): the TensorRT plugin {PLUGIN_ID} needs TensorRT >= 10.8's "
            "Python package: pip install 'tensorrt>=10.8' (Linux/Windows with an NVIDIA driver; "
            "TensorRT for RTX has no plugin module)."
        ) from exc
    return trt, trtp


def kernel_config(query_dtype, cache_dtype, cache_shape, *, num_heads: int, num_kv_heads: int, head_size: int,
                  scale: float, sliding_window: int, softcap: float):
    """The :class:`~.triton_kernel.KernelConfig` for a node with these TensorRT dtypes and static cache shape."""
    trt, _ = _import_trt()
    from llmc.plugins.paged_attention.triton_kernel import KernelConfig

    act = {trt.float16: "fp16", trt.bfloat16: "bf16", trt.float32: "fp32"}.get(query_dtype)
    if act is None:
        raise ValueError(f"{PLUGIN_ID}: query dtype {query_dtype} is not float16, bfloat16 or float32")
    fp8_types = [trt.uint8] + ([trt.fp8] if hasattr(trt, "fp8") else [])
    cache = "u8" if cache_dtype in fp8_types else act if cache_dtype == query_dtype else None
    if cache is None:
        raise ValueError(f"{PLUGIN_ID}: KV cache dtype {cache_dtype} must be the query's ({query_dtype}) or FP8/UINT8")
    _, hkv, block_size, d = (int(x) for x in cache_shape)
    if min(hkv, block_size, d) <= 0:
        raise ValueError(f"{PLUGIN_ID}: the KV cache's last three dimensions must be static, got {tuple(cache_shape)}")
    if hkv != num_kv_heads or d != head_size:
        raise ValueError(f"{PLUGIN_ID}: k_cache {tuple(cache_shape)} does not match num_kv_heads={num_kv_heads}, "
                         f"head_size={head_size}")
    return KernelConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
                        scale=float(scale), act_dtype=act, cache_dtype=cache, sliding_window=int(sliding_window),
                        softcap=float(softcap))


def register(sm: int) -> None:
    """Register the plugin's definitions with TensorRT, compiling for ``sm`` (e.g. 90 for H100/H200).

    Idempotent for one SM; a process builds for one SM (registering again with another raises).
    """
    global _registered_sm
    if _registered_sm is not None:
        if _registered_sm != sm:
            raise RuntimeError(f"{PLUGIN_ID} is registered for sm_{_registered_sm}; one process builds for one SM")
        return
    if sm not in aot.SUPPORTED_SMS:
        raise ValueError(f"sm_{sm}: not a target llmc builds kernels for ({', '.join(map(str, aot.SUPPORTED_SMS))})")
    _, trtp = _import_trt()

    @trtp.register(PLUGIN_ID)
    def _describe(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                  slot_mapping: trtp.TensorDesc, block_tables: trtp.TensorDesc, context_lens: trtp.TensorDesc,
                  query_start_loc: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                  kv_scales: trtp.TensorDesc, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                  sliding_window: int, softcap: float, layer_idx: int
                  ) -> tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        return query.like(), k_cache.aliased(), v_cache.aliased()

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
             slot_mapping: trtp.TensorDesc, block_tables: trtp.TensorDesc, context_lens: trtp.TensorDesc,
             query_start_loc: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
             kv_scales: trtp.TensorDesc, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
             sliding_window: int, softcap: float, layer_idx: int,
             outputs: tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc], tactic: int
             ) -> tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]:
        cfg = kernel_config(query.dtype, k_cache.dtype, tuple(k_cache.shape), num_heads=num_heads,
                            num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
                            sliding_window=sliding_window, softcap=softcap)
        (kernel,) = aot.compile_ptx(cfg, (sm,))
        launch = trtp.KernelLaunchParams()
        # aot.GRID_RULE: cdiv(T, block_q) + S programs along x (idle ones exit at once), one per KV head along y.
        launch.grid_x = trtp.cdiv(query.shape_expr[0], kernel.block_q) + context_lens.shape_expr[0]
        launch.grid_y = num_kv_heads
        launch.grid_z = 1
        launch.block_x = kernel.threads
        launch.shared_mem = kernel.shared_mem
        # The int32 scalars, in the order of aot.PARAMS: num_seqs, max_blocks.
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(context_lens.shape_expr[0]),
                                             trtp.SymInt32(block_tables.shape_expr[1])])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra

    _registered_sm = sm
