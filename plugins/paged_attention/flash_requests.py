"""AOT requests and the launch sequence of the flash attention kernels (:mod:`.flash`); no Triton import here.

The compiler plans with :func:`requests` (one prefill, one decode and one reduce kernel per attention configuration,
compiled by :func:`llmc.plugins.triton_aot.compile_requests`); the CUDA session launches them with
:func:`run_attention`, which the tests also drive under the Triton interpreter (:class:`JitKernel`), so the
launch order, the arguments and the grids tested are the session's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MODULE = "llmc.plugins.paged_attention.flash"
VARIANTS = ("flash-prefill", "flash-decode", "flash-reduce")  # manifest ``variant`` of each kernel
MAX_HEAD_SIZE = 256  # larger heads keep the first kernel (their Q tile and K/V stages would not fit one SM)
STRIDES = ["stride_q", "stride_k", "stride_v"]  # elements between rows of query, key, value (int32 launch scalars)

# Split-KV (flash-decoding). A decode step of a few sequences has Hkv programs per sequence: 8 on an H100's 132 SMs
# for Llama-3.2-1B at batch 1, far from the bandwidth. Splitting each context into slices handled by separate
# programs (then a reduce kernel) fills the GPU. The rule, in decode_num_splits:
# - about PROGRAMS_PER_SM programs per SM: 4, so each SM has several K/V tile loads in flight (a bandwidth-bound
#   kernel needs bytes in flight, not arithmetic; 2 programs per SM left the first kernel at 30% of the bandwidth);
# - never more splits than MIN_SPLIT_LEN-position slices of the longest context the step can hold (the block
#   table's width x block size): below 4 tiles of 64 a slice's partials and the reduce cost more than it gains;
# - at most MAX_SPLITS (the reduce kernel reads them in one padded block).
# The count depends only on shapes (the batch and the block table's width), so a captured CUDA graph (fixed batch
# and table width) launches a fixed grid: each sequence then uses min(count, cdiv(its span, MIN_SPLIT_LEN)) splits,
# decided on the device, and the programs past them exit at once. Not yet timed on a GPU (issue 51).
PROGRAMS_PER_SM = 4
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64
REDUCE_BLOCK_S = 16  # splits the reduce kernel combines per step (a [16, D] float32 tile in registers)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """The split count of a decode launch (see the comment above :data:`PROGRAMS_PER_SM`)."""
    want = max(1, (PROGRAMS_PER_SM * num_sms) // max(1, num_seqs * num_kv_heads))
    most = max(1, -(-int(max_context) // MIN_SPLIT_LEN))
    return max(1, min(want, most, MAX_SPLITS))


@dataclass(frozen=True)
class Tiling:
    """Tiles of one kernel: ``block_m`` query rows (prefill: tokens x group heads; decode: the group's heads, at
    least 16 for tl.dot), ``block_n`` key positions per step, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiling(head_size: int, group: int) -> Tiling:
    """FlashAttention-2's forward shapes for sm_90 (Triton's fused-attention tutorial: 128 x 64 tiles, 8 warps, 3
    stages for heads up to 128; 64 x 32 at 256): a 128-row tile holds 128 / group tokens of the group's heads. To
    revisit with GPU figures."""
    if head_size <= 64:
        t = Tiling(128, 64, 4, 3)
    elif head_size <= 128:
        t = Tiling(128, 64, 8, 3)
    else:
        t = Tiling(64, 32, 4, 2)
    return Tiling(max(t.block_m, _pow2(group)), t.block_n, t.num_warps, t.num_stages)


def decode_tiling(head_size: int, group: int) -> Tiling:
    """One token's group heads (padded to 16 rows, tl.dot's least) over 64-position tiles (32 at heads of 256),
    3 stages: a K and a V tile of 16 KiB (bf16, D 128) per stage in flight."""
    return Tiling(max(16, _pow2(group)), 64 if head_size <= 128 else 32, 4, 3)


# The kernels' constexpr parameters, in their order in flash.py (an AOT signature lists parameters in order).
_PREFILL_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "HEAD_PAD", "BLOCK_SIZE", "SCALE", "SOFTCAP", "WINDOW",
                       "FP8", "FP8_NATIVE", "DOT_F32", "PRECISION", "BLOCK_M", "BLOCK_Q", "BLOCK_Q_PAD", "BLOCK_N",
                       "HAS_SINKS", "ALIBI", "ALIBI_N", "CHUNK", "HAS_ATTEND_END")
_DECODE_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_SIZE", "HEAD_PAD", "BLOCK_SIZE", "SCALE", "SOFTCAP", "WINDOW",
                      "FP8", "FP8_NATIVE", "DOT_F32", "PRECISION", "BLOCK_H", "BLOCK_N", "MIN_SPLIT", "HAS_SINKS",
                      "ALIBI", "ALIBI_N", "CHUNK")
_REDUCE_CONSTEXPRS = ("NUM_HEADS", "HEAD_SIZE", "HEAD_PAD", "WINDOW", "CHUNK", "FP8", "BLOCK_N", "MIN_SPLIT",
                      "SPLITS_PAD", "BLOCK_S", "HAS_SINKS")


def _common(attrs: dict, act: str, cache: str, block_size: int, fp8_native: bool, interpret: bool) -> dict:
    num_heads, head_size = int(attrs["num_heads"]), int(attrs["head_size"])
    dot_f32 = interpret or act == "fp32"  # the interpreter's numpy has no bfloat16; float32 engines stay IEEE
    return {"NUM_HEADS": num_heads, "NUM_KV_HEADS": int(attrs["num_kv_heads"]), "HEAD_SIZE": head_size,
            "HEAD_PAD": max(16, _pow2(head_size)), "BLOCK_SIZE": int(block_size), "SCALE": float(attrs["scale"]),
            "SOFTCAP": float(attrs.get("softcap", 0.0)), "WINDOW": int(attrs.get("sliding_window", 0)),
            "FP8": cache == "u8", "FP8_NATIVE": bool(fp8_native and cache == "u8" and not interpret),
            "DOT_F32": dot_f32, "PRECISION": "ieee" if dot_f32 else "tf32",
            "ALIBI": float(attrs.get("alibi_max_bias", 0.0)), "ALIBI_N": 1 << (num_heads.bit_length() - 1),
            "CHUNK": int(attrs.get("attention_chunk", 0))}


def requests(key: str, attrs: dict, *, act: str, cache: str, block_size: int, fp8_native: bool = True,
             interpret: bool = False, prefill: Tiling | None = None, decode: Tiling | None = None,
             min_split: int = MIN_SPLIT_LEN) -> dict[str, dict]:
    """variant -> AOT request (:mod:`llmc.plugins.triton_aot`) of one attention configuration (a PagedAttention
    node's attributes; ``has_sinks``/``has_attend_end`` set where it takes them). ``act``/``cache``: Triton dtype
    names (``u8``: FP8 E4M3 codes). ``fp8_native``: hardware E4M3 conversion (sm_89+). ``interpret``: constexprs
    for the Triton interpreter (float32 dots). ``prefill``/``decode``: tilings other than the defaults, ``min_split``
    the least positions of a split (tests: many splits over short contexts)."""
    num_heads, hkv, head_size = int(attrs["num_heads"]), int(attrs["num_kv_heads"]), int(attrs["head_size"])
    if num_heads % hkv:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {hkv}")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head size {head_size}: the flash kernels take heads up to {MAX_HEAD_SIZE}")
    group = num_heads // hkv
    sinks, attend_end = bool(attrs.get("has_sinks")), bool(attrs.get("has_attend_end"))
    common = _common(attrs, act, cache, block_size, fp8_native, interpret)
    idx = "i64"  # slot_mapping, block_tables, context_lens, query_start_loc, attend_end: the op schema's int64
    inputs = {"q_ptr": f"*{act}", "k_ptr": f"*{act}", "v_ptr": f"*{act}", "slot_ptr": f"*{idx}", "bt_ptr": f"*{idx}",
              "ctx_ptr": f"*{idx}", "qsl_ptr": f"*{idx}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
              "kv_scale_ptr": "*fp32", "sinks_ptr": "*fp32" if sinks else "constexpr"}
    divisible = ["q_ptr", "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_acc_ptr"]
    if head_size % 16 == 0:  # rows of whole heads: 16-element strides (run_attention copies a view that has not)
        divisible += STRIDES

    pt = prefill or prefill_tiling(head_size, group)
    block_q = max(1, pt.block_m // group)
    every = {**common, "BLOCK_M": pt.block_m, "BLOCK_Q": block_q, "BLOCK_Q_PAD": _pow2(block_q), "BLOCK_N": pt.block_n,
             "HAS_SINKS": sinks, "HAS_ATTEND_END": attend_end}
    p_const = {n: every[n] for n in _PREFILL_CONSTEXPRS}  # in the kernel's parameter order (the AOT signature's)
    strides = dict.fromkeys(STRIDES, "i32")
    p_sig = {**inputs, "attend_end_ptr": f"*{idx}" if attend_end else "constexpr", "num_seqs": "i32",
             "max_blocks": "i32", **strides, "out_ptr": f"*{act}", **dict.fromkeys(p_const, "constexpr")}

    dt = decode or decode_tiling(head_size, group)
    every = {**common, "BLOCK_H": dt.block_m, "BLOCK_N": dt.block_n, "MIN_SPLIT": int(min_split), "HAS_SINKS": sinks,
             "SPLITS_PAD": MAX_SPLITS, "BLOCK_S": REDUCE_BLOCK_S}
    d_const = {n: every[n] for n in _DECODE_CONSTEXPRS}
    d_sig = {**inputs, "num_seqs": "i32", "max_blocks": "i32", "num_splits": "i32", **strides, "out_ptr": f"*{act}",
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
             **dict.fromkeys(d_const, "constexpr")}

    r_const = {n: every[n] for n in _REDUCE_CONSTEXPRS}
    r_sig = {"ctx_ptr": f"*{idx}", "qsl_ptr": f"*{idx}", "kv_scale_ptr": "*fp32",
             "sinks_ptr": "*fp32" if sinks else "constexpr", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
             "part_acc_ptr": "*fp32", "num_seqs": "i32", "num_splits": "i32", "out_ptr": f"*{act}",
             **dict.fromkeys(r_const, "constexpr")}

    def req(variant: str, fn: str, sig: dict, const: dict, tiling: Tiling | None, grid: str) -> dict:
        const = {**const, **{p: None for p, t in sig.items() if t == "constexpr" and p.endswith("_ptr")}}
        return {"key": key, "variant": variant, "op": "paged_attention", "module": MODULE, "fn": fn,
                "signature": sig, "constexprs": const,
                "num_warps": tiling.num_warps if tiling else 4, "num_stages": tiling.num_stages if tiling else 1,
                "divisible": [p for p in divisible if p in sig], "grid_rule": grid}

    return {"flash-prefill": req("flash-prefill", "flash_prefill_kernel", p_sig, p_const, pt,
                                 "(cdiv(num_tokens, BLOCK_Q) + num_seqs, NUM_KV_HEADS, 1)"),
            "flash-decode": req("flash-decode", "split_kv_decode_kernel", d_sig, d_const, dt,
                                "(num_seqs, NUM_KV_HEADS, num_splits)"),
            "flash-reduce": req("flash-reduce", "split_kv_reduce_kernel", r_sig, r_const, None,
                                "(num_seqs, NUM_HEADS, 1) when num_splits > 1")}


def params(request: dict) -> list[str]:
    """A request's launch parameters in order (its non-constexpr signature entries)."""
    return [n for n, t in request["signature"].items() if t != "constexpr"]


class JitKernel:
    """A request's kernel launched by Triton itself (the interpreter on CPU tensors, or Triton's JIT on a GPU), with
    the request's constexprs: what tests run :func:`run_attention` with. Same ``launch`` as the session's kernels."""

    def __init__(self, request: dict) -> None:
        import importlib

        self.request = request
        self.config = dict(request["constexprs"])
        self.params = params(request)
        self._fn = getattr(importlib.import_module(request["module"]), request["fn"])
        self.launches: list[tuple[int, int, int]] = []

    def launch(self, grid: tuple[int, int, int], args: list, stream: int = 0) -> None:
        del stream
        self.launches.append(tuple(grid))
        bound = dict(zip(self.params, args, strict=True))
        self._fn[grid](**bound, **{k: v for k, v in self.config.items() if k not in bound},
                       num_warps=self.request["num_warps"], num_stages=self.request["num_stages"])


@dataclass
class FlashKernels:
    """The three kernels of one attention configuration (anything with ``launch(grid, args, stream)`` and, for the
    prefill kernel, the ``BLOCK_Q`` of its grid)."""

    prefill: object
    decode: object
    reduce: object
    block_q: int
    num_kv_heads: int
    num_heads: int
    head_size: int
    sinks: bool
    attend_end: bool


def run_attention(kernels: FlashKernels, query, key, value, slot_mapping, block_tables, context_lens,
                  query_start_loc, k_cache, v_cache, kv_scales, *, sinks=None, attend_end=None, num_sms: int,
                  stream: int = 0, num_splits: int | None = None, out=None,
                  new: Callable | None = None):
    """Write the step's K/V into the caches and attend: the decode kernels when every sequence has one new row
    (``T == S``: every scheduled chunk has at least one token, runtime/core/step.py), else the prefill kernel.
    Returns ``[T, H * D]`` (rows past ``query_start_loc[-1]`` are left as ``out`` held them).

    Tensors as :func:`.triton_kernel.paged_attention` takes them (rows of query, key, value may be strided views;
    int64 metadata; caches
    ``[blocks, Hkv, block_size, D]``, ``uint8`` for FP8 with ``kv_scales`` float32 ``[2]``, which every kernel
    takes). ``num_splits``: the decode split count (default :func:`decode_num_splits` of the shapes: never a host
    read of a device value, so a CUDA graph captures it). ``new(shape, dtype)``: allocates the split partials (the
    session's allocator; default ``torch.empty`` on the query's device)."""
    import torch

    t, s = query.shape[0], context_lens.shape[0]
    if (sinks is not None) != kernels.sinks:
        raise ValueError(f"the attention kernels were built {'with' if kernels.sinks else 'without'} attention "
                         f"sinks, but the call {'passes' if sinks is not None else 'does not pass'} them")
    if attend_end is not None and not kernels.attend_end:
        raise ValueError("the attention kernels were built without attend_end, but the call passes it")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if t == 0 or s == 0:
        return out
    # Row strides instead of copies (key and value are views of the packed QKV projection); a view the kernels
    # cannot take (elements not contiguous, or a stride off the 16-element alignment the AOT kernel assumes for
    # heads of whole 16s) is copied.
    q, k, v = (x if x.stride(-1) == 1 and x.stride(0) % 16 == 0 else x.contiguous() for x in (query, key, value))
    strides = [q.stride(0), k.stride(0), v.stride(0)]
    scales = [kv_scales]
    opt = [sinks] if kernels.sinks else []
    if t != s:
        if kernels.attend_end:  # a kernel built for it reads it: all-causal rows (0) where the caller has none
            attend_end = attend_end if attend_end is not None else torch.zeros(t, dtype=torch.int64,
                                                                               device=query.device)
            opt = [*opt, attend_end]
        grid = (-(-t // kernels.block_q) + s, kernels.num_kv_heads, 1)
        kernels.prefill.launch(grid, [q, k, v, slot_mapping, block_tables, context_lens, query_start_loc, k_cache,
                                      v_cache, *scales, *opt, s, block_tables.shape[1], *strides, out], stream)
        return out
    if num_splits is None:
        num_splits = decode_num_splits(s, kernels.num_kv_heads, block_tables.shape[1] * k_cache.shape[2], num_sms)
    alloc = new or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=query.device))
    if num_splits > 1:
        parts = [alloc((t, kernels.num_heads, num_splits), torch.float32),
                 alloc((t, kernels.num_heads, num_splits), torch.float32),
                 alloc((t, kernels.num_heads, num_splits, kernels.head_size), torch.float32)]
    else:  # never written with one split (the kernel writes out): any float32 pointer
        parts = [kv_scales] * 3
    kernels.decode.launch((s, kernels.num_kv_heads, num_splits),
                          [q, k, v, slot_mapping, block_tables, context_lens, query_start_loc, k_cache, v_cache,
                           *scales, *opt, s, block_tables.shape[1], num_splits, *strides, out, *parts], stream)
    if num_splits > 1:
        kernels.reduce.launch((s, kernels.num_heads, 1), [context_lens, query_start_loc, *scales, *opt, *parts, s,
                                                          num_splits, out], stream)
    return out


def jit_kernels(attrs: dict, *, act: str, cache: str, block_size: int, interpret: bool = True,
                prefill: Tiling | None = None, decode: Tiling | None = None,
                min_split: int = MIN_SPLIT_LEN) -> FlashKernels:
    """:class:`FlashKernels` of :class:`JitKernel` for ``attrs`` (tests: the interpreter)."""
    reqs = requests("test", attrs, act=act, cache=cache, block_size=block_size, interpret=interpret,
                    prefill=prefill, decode=decode, min_split=min_split)
    group = int(attrs["num_heads"]) // int(attrs["num_kv_heads"])
    return FlashKernels(prefill=JitKernel(reqs["flash-prefill"]), decode=JitKernel(reqs["flash-decode"]),
                        reduce=JitKernel(reqs["flash-reduce"]), block_q=max(1, reqs["flash-prefill"]["constexprs"]
                                                                            ["BLOCK_M"] // group),
                        num_kv_heads=int(attrs["num_kv_heads"]), num_heads=int(attrs["num_heads"]),
                        head_size=int(attrs["head_size"]), sinks=bool(attrs.get("has_sinks")),
                        attend_end=bool(attrs.get("has_attend_end")))
