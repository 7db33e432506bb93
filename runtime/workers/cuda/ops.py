"""The operators of a CUDA engine's program, in torch, with ONNX semantics.

A CUDA engine (:mod:`llmc.runtime.workers.cuda.program`) is the compiler's fused graph written as a flat
list of nodes; each node's ``op`` names a function here. Every function takes the node's input
tensors (``None`` for an omitted optional input) and its attributes as keywords, and returns a
tuple of outputs. They run on whatever device their inputs live on: CUDA in production, the CPU
in CI, which is how the lowering and the executor are tested without a GPU.

Precision follows transformers' mixed-precision habits: normalisations, softmax and rotary run in
float32 and round back to the activation dtype; a binary op between a low-precision activation and
a float32 tensor computes in the activation's dtype (as transformers does once parameters are
cast), see :func:`_align`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# ONNX TensorProto data types -> torch (Cast's "to", and the program's dtype names)
ONNX_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 6: torch.int32, 7: torch.int64, 9: torch.bool,
               10: torch.float16, 11: torch.float64, 16: torch.bfloat16, 17: torch.float8_e4m3fn}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
          "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0
_I64_MAX = 2**63 - 1

OPS: dict[str, Callable] = {}


def op(name: str):
    def register(fn):
        OPS[name] = fn
        return fn
    return register


def _align(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # float32 constants meeting bf16/fp16 activations compute in the activation dtype (what a
    # transformers model whose parameters were cast does); float32 x float32 stays float32.
    if a.dtype != b.dtype and a.is_floating_point() and b.is_floating_point():
        low = a.dtype if a.element_size() < b.element_size() else b.dtype
        return a.to(low), b.to(low)
    return a, b


def _binary(fn):
    def run(a, b, **_):
        a, b = _align(a, b)
        return (fn(a, b),)
    return run


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # ONNX Div of integers truncates (torch.div would divide exactly, into floats: Idefics3's floor_divide, which
    # the exporter writes as Div and a sign correction, indexed its position buckets with floats)
    if a.is_floating_point() or b.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


for _name, _fn in {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _div,
                   "Greater": torch.gt, "Less": torch.lt, "Equal": torch.eq, "Max": torch.maximum,
                   "Min": torch.minimum, "GreaterOrEqual": torch.ge, "LessOrEqual": torch.le,
                   "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor}.items():
    OPS[_name] = _binary(_fn)

for _name, _fn in {"Neg": torch.neg, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "Cos": torch.cos,
                   "Sin": torch.sin, "Sqrt": torch.sqrt, "Exp": torch.exp, "Relu": torch.relu, "Erf": torch.erf,
                   "Reciprocal": torch.reciprocal, "Abs": torch.abs, "Not": torch.logical_not,
                   "Floor": torch.floor, "Log": torch.log,  # llama4's NoPE temperature tuning
                   "Identity": lambda x: x}.items():
    OPS[_name] = (lambda f: lambda x, **_: (f(x),))(_fn)


@op("Mod")
def mod(a, b, *, fmod=0, **_):
    """ONNX Mod: the divisor's sign (Python's %, ``fmod=0``) or the dividend's (C's fmod)."""
    a, b = _align(a, b)
    return ((torch.fmod if fmod else torch.remainder)(a, b),)


@op("Pow")
def pow_(x, y, **_):
    if isinstance(y, float):  # a constant exponent (the program passes scalars as floats)
        return (torch.pow(x, y),)
    x, y = _align(x, y)
    return (torch.pow(x, y),)


@op("Clip")
def clip(x, lo=None, hi=None, **_):
    """ONNX Clip: optional 0-D ``min`` / ``max`` (gpt-oss clamps its SwiGLU halves)."""
    lo = lo.to(x.dtype) if isinstance(lo, torch.Tensor) else lo
    hi = hi.to(x.dtype) if isinstance(hi, torch.Tensor) else hi
    return (torch.clamp(x, min=lo, max=hi),)


@op("Cast")
def cast(x, *, to: str, **_):
    return (x.to(DTYPES[to]),)


@op("Where")
def where(cond, a, b, **_):
    a, b = _align(a, b)
    return (torch.where(cond, a, b),)


@op("MatMul")
def matmul(a, b, **_):
    a, b = _align(a, b)
    return (torch.matmul(a, b),)


@op("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, **_):
    a = a.transpose(-1, -2) if transA else a
    b = b.transpose(-1, -2) if transB else b
    a, b = _align(a, b)
    y = torch.matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c.to(y.dtype) * beta if beta != 1.0 else c.to(y.dtype))
    return (y,)


@op("Gather")
def gather(data, indices, *, axis=0, **_):
    axis = axis % data.dim()
    idx = torch.where(indices < 0, indices + data.shape[axis], indices) if indices.dtype.is_signed else indices
    out = data.index_select(axis, idx.reshape(-1))
    return (out.reshape([*data.shape[:axis], *indices.shape, *data.shape[axis + 1:]]),)  # a list: 0-D too


@op("GatherND")
def gather_nd(data, indices, *, batch_dims=0, **_):
    if batch_dims:
        raise NotImplementedError("GatherND with batch_dims > 0")
    r = indices.shape[-1]
    return (data[tuple(indices[..., i] for i in range(r))],)


@op("Split")
def split(x, sizes=None, *, axis=0, num_outputs=None, **_):
    if sizes is None:
        n = x.shape[axis]
        sizes = [-(-n // num_outputs)] * (num_outputs - 1)
        sizes.append(n - sum(sizes))
    return tuple(torch.split(x, [int(s) for s in sizes], dim=axis))


def _reshape_target(x: torch.Tensor, shape, allowzero: int) -> list[int]:
    out = [int(s) for s in shape]
    if not allowzero:
        out = [x.shape[i] if s == 0 else s for i, s in enumerate(out)]
    return out


@op("Reshape")
def reshape(x, shape, *, allowzero=0, **_):
    return (x.reshape(_reshape_target(x, shape, allowzero)),)


@op("Unsqueeze")
def unsqueeze(x, axes, **_):
    rank = x.dim() + len(axes)
    for a in sorted(int(a) % rank for a in axes):
        x = x.unsqueeze(a)
    return (x,)


@op("Squeeze")
def squeeze(x, axes=None, **_):
    if axes is None:
        return (x.squeeze(),)
    return (x.squeeze(tuple(int(a) % x.dim() for a in axes)),)


@op("Transpose")
def transpose(x, *, perm=None, **_):
    return (x.permute(*(perm if perm is not None else reversed(range(x.dim())))),)


@op("Expand")
def expand(x, shape, **_):
    return (x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(int(s) for s in shape))),)


@op("Tile")
def tile(x, repeats, **_):  # llama4's MoE repeats its tokens once per expert
    return (x.repeat(*(int(r) for r in repeats)),)


@op("Concat")
def concat(*xs, axis=0, **_):
    xs = [x for x in xs if x is not None]
    floats = [x.dtype for x in xs if x.is_floating_point()]
    if len(set(floats)) > 1:  # mixed precisions: the narrowest, as _align does
        low = min(floats, key=lambda d: torch.tensor([], dtype=d).element_size())
        xs = [x.to(low) if x.is_floating_point() else x for x in xs]
    return (torch.cat(xs, dim=axis),)


@op("Slice")
def slice_(x, starts, ends, axes=None, steps=None, **_):
    axes = list(range(len(starts))) if axes is None else [int(a) % x.dim() for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    index = [slice(None)] * x.dim()
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        if st <= 0:
            raise NotImplementedError("Slice with a step below 1")
        n = x.shape[a]
        s, e = int(s), int(e)
        s = max(0, min(n, s + n if s < 0 else s))
        e = max(0, min(n, e + n if e < 0 else e)) if e < _I64_MAX else n
        index[a] = slice(s, e, st)
    return (x[tuple(index)],)


@op("Softmax")
def softmax(x, *, axis=-1, **_):
    return (torch.softmax(x.float(), dim=axis).to(x.dtype),)


@op("TopK")
def topk(x, k, *, axis=-1, largest=1, sorted=1, **_):  # noqa: A002 - ONNX's attribute name
    values, indices = torch.topk(x, int(k.reshape(-1)[0]) if isinstance(k, torch.Tensor) else int(k[0]),
                                 dim=axis, largest=bool(largest), sorted=bool(sorted))
    return values, indices


@op("ReduceSum")
def reduce_sum(x, axes=None, *, keepdims=1, noop_with_empty_axes=0, **_):
    if axes is None or len(axes) == 0:
        if noop_with_empty_axes:
            return (x,)
        return (x.sum().reshape([1] * x.dim()) if keepdims else x.sum(),)
    return (x.sum(dim=tuple(int(a) for a in axes), keepdim=bool(keepdims)),)


@op("ReduceMean")
def reduce_mean(x, axes=None, *, keepdims=1, **_):
    dims = tuple(range(x.dim())) if axes is None else tuple(int(a) for a in axes)
    return (x.mean(dim=dims, keepdim=bool(keepdims)),)


def _reduce_extreme(fn):
    def run(x, axes=None, *, keepdims=1, noop_with_empty_axes=0, **_):
        if axes is None or len(axes) == 0:
            if noop_with_empty_axes:
                return (x,)
            axes = range(x.dim())
        return (fn(x, dim=tuple(int(a) for a in axes), keepdim=bool(keepdims)),)
    return run


OPS["ReduceMax"] = _reduce_extreme(torch.amax)
OPS["ReduceMin"] = _reduce_extreme(torch.amin)


@op("Gelu")
def gelu(x, *, approximate="none", **_):
    return (F.gelu(x, approximate=approximate),)


@op("Conv")
def conv(x, w, b=None, *, strides=None, pads=None, dilations=None, group=1, auto_pad="NOTSET", **_):
    """ONNX Conv over 1-3 spatial axes (an encoder's patch embedding), explicit padding only."""
    if auto_pad not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"Conv auto_pad={auto_pad!r}")
    x, w = _align(x, w)
    nd = w.dim() - 2
    pads = list(pads or [0] * (2 * nd))
    begin, end = pads[:nd], pads[nd:]
    if begin != end:  # asymmetric: pad first (torch's convolutions take one padding per axis)
        x = F.pad(x, [p for i in reversed(range(nd)) for p in (begin[i], end[i])])
        begin = [0] * nd
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return (fn(x, w, None if b is None else b.to(x.dtype), stride=list(strides or [1] * nd), padding=begin,
               dilation=list(dilations or [1] * nd), groups=int(group)),)


@op("AveragePool")
def average_pool(x, *, kernel_shape, strides=None, pads=None, ceil_mode=0, count_include_pad=0, auto_pad="NOTSET",
                 dilations=None, **_):
    """ONNX AveragePool over 1-2 spatial axes (Gemma 3's projector pools the patch grid), symmetric padding."""
    nd = len(kernel_shape)
    pads = list(pads or [0] * (2 * nd))
    if auto_pad not in ("NOTSET", "VALID") or pads[:nd] != pads[nd:] or any(d != 1 for d in dilations or ()):
        raise NotImplementedError(f"AveragePool auto_pad={auto_pad!r} pads={pads} dilations={dilations}")
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d}[nd]
    return (fn(x, list(kernel_shape), list(strides or kernel_shape), pads[:nd], bool(ceil_mode),
               bool(count_include_pad)),)


@op("EncoderAttention")
def encoder_attention(q, k, v, *, scale=1.0, key_transposed=1, **_):
    """``softmax(q kᵀ · scale) v`` over ``[B, H, S, D]`` with no mask (an encoder's attention, fused by the
    compiler from its MatMul/Softmax/MatMul): torch's fused attention (flash / memory-efficient kernels on a GPU),
    the softmax in float32 as the eager ops compute it."""
    if key_transposed:
        k = k.transpose(-1, -2)
    dtype = q.dtype
    return (F.scaled_dot_product_attention(q, k.to(dtype), v.to(dtype), scale=float(scale)),)


@op("Shape")
def shape(x, *, start=0, end=None, **_):
    # Host metadata (int64 on the CPU, as ONNX Runtime keeps shapes): consumers read it as Python ints, so it
    # costs no device round trip. DeepSeek-V3's grouped router (zeros_like + scatter_) is where programs have it.
    return (torch.tensor(list(x.shape)[start:end], dtype=torch.int64),)


@op("ConstantOfShape")
def constant_of_shape(shape, *, value=(0.0,), dtype="float32", **_):
    # On the CPU: the consumer that meets a device tensor moves it (ScatterElements below).
    return (torch.full([int(s) for s in shape], value[0], dtype=DTYPES[dtype]),)


@op("Range")
def range_(start, limit, delta, **_):
    """Host metadata, as Shape: Qwen3.5's interleaved M-RoPE indexes its frequency slots with ``arange`` over a
    static width (the program passes constant operands as Python lists, computed ones come from Shape)."""
    def scalar(v):
        return v[0] if isinstance(v, list) else v.reshape(-1)[0].item()

    return (torch.arange(scalar(start), scalar(limit), scalar(delta), dtype=torch.int64),)


@op("ScatterND")
def scatter_nd(data, indices, updates, *, reduction="none", **_):
    if reduction != "none":
        raise NotImplementedError(f"ScatterND with reduction {reduction!r}")
    out = data.clone()
    idx = indices.to(data.device)
    out[tuple(idx[..., i] for i in range(idx.shape[-1]))] = updates.to(data.device, data.dtype)
    return (out,)


@op("Softplus")
def softplus(x, **_):  # Gated DeltaNet's decay: g = -exp(A_log) * softplus(a + dt_bias)
    return (F.softplus(x.float()).to(x.dtype),)


@op("GatherElements")
def gather_elements(data, indices, *, axis=0, **_):
    idx = torch.where(indices < 0, indices + data.shape[axis], indices)
    return (torch.gather(data, axis, idx.to(data.device)),)


@op("ScatterElements")
def scatter_elements(data, indices, updates, *, axis=0, reduction="none", **_):
    if reduction != "none":
        raise NotImplementedError(f"ScatterElements with reduction {reduction!r}")
    idx = torch.where(indices < 0, indices + data.shape[axis], indices).to(data.device)
    if updates.device.type == "cpu" and updates.numel() and bool((updates == updates.reshape(-1)[0]).all()):
        # a host fill (ConstantOfShape: scatter_(dim, idx, 1)): scattered as a scalar, no host-to-device copy
        # (which a CUDA graph being captured would refuse)
        return (torch.scatter(data, axis, idx, updates.reshape(-1)[0].item()),)
    return (torch.scatter(data, axis, idx, updates.to(data.device, data.dtype)),)


@op("Pad")
def pad(x, pads, value=None, axes=None, *, mode="constant", **_):
    """ONNX Pad, constant mode: ``pads`` = all begins then all ends (the frontend widens MLA's value heads)."""
    if mode != "constant":
        raise NotImplementedError(f"Pad mode {mode!r}")
    pads = [int(p) for p in pads]
    axes = list(range(x.dim())) if axes is None else [int(a) % x.dim() for a in axes]
    n = len(axes)
    widths = [0, 0] * x.dim()  # F.pad's order: last axis first, (begin, end) each
    for a, lo, hi in zip(axes, pads[:n], pads[n:], strict=True):
        widths[2 * (x.dim() - 1 - a)], widths[2 * (x.dim() - 1 - a) + 1] = lo, hi
    fill = float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) and value.numel() else 0.0
    return (F.pad(x, widths, value=fill),)


def fp8_codes(x: torch.Tensor, act_scale: torch.Tensor) -> torch.Tensor:
    """``E4M3(x / act_scale)``, saturated to ±448: an FP8 linear's input with its static scale (``QuantizeLinear``)."""
    return (x.float() / act_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _maybe_fp8(y: torch.Tensor, act_scale: torch.Tensor | None) -> torch.Tensor:
    # A node the lowering made emit its FP8 linear's input (attribute fp8_out, the scale its last input).
    return y if act_scale is None else fp8_codes(y, act_scale)


@op("SwiGLU")
def swiglu(gate, up, act_scale=None, **_):
    return (_maybe_fp8(F.silu(gate) * up, act_scale),)


def _rms(x: torch.Tensor, scale: torch.Tensor, eps: float, axis: int) -> torch.Tensor:
    dims = tuple(range(axis % x.dim(), x.dim()))
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + eps)
    if scale.dtype == torch.float32:
        return (y * scale).to(x.dtype)
    return y.to(x.dtype) * scale


@op("RMSNormalization")
def rms_norm(x, scale, act_scale=None, *, epsilon=1e-5, axis=-1, **_):
    return (_maybe_fp8(_rms(x, scale, epsilon, axis), act_scale),)


@op("SkipRMSNormalization")
def skip_rms_norm(x, skip, scale, act_scale=None, *, epsilon=1e-5, **_):
    x, skip = _align(x, skip)
    s = x + skip
    return _maybe_fp8(_rms(s, scale, epsilon, -1), act_scale), s


@op("LayerNormalization")
def layer_norm(x, scale, bias=None, *, axis=-1, epsilon=1e-5, **_):
    axis = axis % x.dim()
    shape = tuple(x.shape[axis:])
    y = F.layer_norm(x.float(), shape, scale.float(), None if bias is None else bias.float(), epsilon)
    return (y.to(x.dtype),)


@op("RotaryEmbedding")
def rotary(x, cos, sin, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0, **_):
    """ONNX RotaryEmbedding: ``x [B, T, H*D]`` (3D, ``num_heads`` set) or ``[B, H, T, D]`` (4D), with
    ``cos``/``sin [B, T, R/2]`` (or ``[max_pos, R/2]`` indexed by ``position_ids [B, T]``)."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    shape = x.shape
    if x.dim() == 4:  # [B, H, T, D]: the angles broadcast over the heads axis
        xs, d, head_axis = x, shape[-1], 1
    else:  # [B, T, H*D] -> [B, T, H, D]
        d = shape[-1] // num_heads
        xs, head_axis = x.reshape(*shape[:-1], num_heads, d), -2
    rot = rotary_embedding_dim or d
    half = rot // 2
    c = cos[..., :half].float().unsqueeze(head_axis)
    s = sin[..., :half].float().unsqueeze(head_axis)
    xr = xs[..., :rot].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = out.to(x.dtype)
    if rot < d:
        out = torch.cat((out, xs[..., rot:]), dim=-1)
    return (out.reshape(shape),)


def _broadcast_axis(param: torch.Tensor, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    if param.dim() == 0 or param.numel() == 1:
        return param.reshape(())
    if block_size:  # blocked: repeat each entry block_size times along the axis, cut to x's length
        param = param.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
        return param
    axis = axis % x.dim()
    return param.reshape([-1 if i == axis else 1 for i in range(x.dim())])


@op("DequantizeLinear")
def dequantize(x, scale, zero_point=None, *, axis=1, block_size=0, output_dtype=0, **_):
    y = x.float()
    if zero_point is not None and not zero_point.dtype.is_floating_point:
        y = y - _broadcast_axis(zero_point.float(), x, axis, block_size)
    y = y * _broadcast_axis(scale.float(), x, axis, block_size)
    return (y.to(scale.dtype) if scale.dtype != torch.float32 else y,)


@op("QuantizeLinear")
def quantize(x, scale, zero_point=None, *, axis=1, saturate=1, block_size=0, **_):
    if zero_point is None or zero_point.dtype != torch.float8_e4m3fn:
        raise NotImplementedError("QuantizeLinear to an integer type (llmc's graphs quantize to FP8 only)")
    y = x.float() / _broadcast_axis(scale.float(), x, axis, block_size)
    if saturate:
        y = y.clamp(-FP8_MAX, FP8_MAX)  # NaN passes through clamp, as ONNX keeps NaN
    return (y.to(torch.float8_e4m3fn),)


# -- fused linear layers the CUDA lowering makes ------------------------------------------------


@op("Fp8Linear")
def fp8_linear(x, w8, w_scales, act_scale, *, mode="emulate", x_fp8=0, dtype=None, **_):
    """``Q/DQ(x, act_scale) @ DQ(w8 [N, K] E4M3, w_scales [N])``: FP8 GEMM with a static activation scale.

    ``x_fp8``: ``x`` is already ``E4M3(x / act_scale)`` (the node before emitted the codes) and ``dtype`` names
    the output's. ``mode="scaled_mm"`` runs ``torch._scaled_mm`` on device tensors (sm_89+ tensor cores, float32
    accumulation, row-wise scales); CPU tensors and ``"emulate"`` compute the same products in float32. A CUDA session
    with its kernels runs its own version (prepared scales, the quantize kernel: ``CudaSession``).
    """
    shape = x.shape
    out_dtype = DTYPES[dtype] if x_fp8 else x.dtype
    x2 = x.reshape(-1, shape[-1])
    xq = x2 if x_fp8 else fp8_codes(x2, act_scale)
    if mode == "scaled_mm" and x.device.type != "cpu":  # tensor cores; on the CPU the same products in float32
        m = x2.shape[0]
        y = torch._scaled_mm(xq, w8.t(), scale_a=act_scale.reshape(1, 1).expand(m, 1).contiguous(),
                             scale_b=w_scales.reshape(1, -1), out_dtype=out_dtype)
    else:
        y = (xq.float() * act_scale) @ (w8.float() * w_scales.reshape(-1, 1)).t()
    return (y.to(out_dtype).reshape(*shape[:-1], -1),)


@op("LoraApply")
def lora_apply(y, x, a, b, slots, *, rank: int, **_):
    """``y + B_s(A_s x)`` per token, ``s`` its LoRA slot (llmc.passes.lora; the reference of the shrink/expand
    kernels a GPU launches instead)."""
    from llmc.plugins.lora.reference import lora_apply as reference

    return (reference(y, x, a.to(x.dtype), b.to(x.dtype), slots, rank),)


@op("Int4Linear")
def int4_linear(x, codes, scales, zeros=None, *, group_size: int, k: int, **_):
    """``x @ W`` with ``W [K, N]`` stored as 4-bit ``codes`` (two per byte along K: ``[ceil(K/2), N]``
    uint8, low nibble first), ``scales [K/g, N]`` and optional ``zeros [K/g, N]`` (uint8 0..15; without
    them the codes are signed, -8..7). Dequantizes, then multiplies (W4A16)."""
    lo = (codes & 0x0F).to(torch.int16)
    hi = (codes >> 4).to(torch.int16)
    q = torch.stack((lo, hi), dim=1).reshape(-1, codes.shape[1])[:k]
    if zeros is None:
        q = q - 16 * (q >= 8).to(torch.int16)
        w = q.to(scales.dtype) * scales.repeat_interleave(group_size, 0)[:k]
    else:
        w = (q - zeros.to(torch.int16).repeat_interleave(group_size, 0)[:k]).to(scales.dtype) \
            * scales.repeat_interleave(group_size, 0)[:k]
    a, w = _align(x, w.to(x.dtype) if x.dtype != torch.float32 else w.float())
    return (torch.matmul(a, w),)


@op("Mxfp4MoEMatMul")
def mxfp4_moe_matmul(x, expert_ids, blocks, scales, **_):
    """Row ``m`` of ``x [..., K]`` times expert ``expert_ids[m]``'s MXFP4 weight (gpt-oss's layout, kept as stored:
    ``blocks [E, N, K/32, 16]`` E2M1 pairs, low nibble first; ``scales [E, N, K/32]`` E8M0, bias 127), ``[..., N]``.
    Each row's codes are gathered and decoded in ``x``'s dtype (a 3-bit significand times a power of two: exact in
    float32 and bfloat16 over the exponents a checkpoint uses), then one batched matmul (W4A16): the shapes depend
    on the row count only, as the float experts' gather-then-matmul they replace. The E2M1 values are computed from
    the code bits (no table copied to the device: nothing here breaks a CUDA graph's capture). A CUDA session with
    its kernels runs the grouped kernel instead (``FusedOps.mxfp4_moe``: no expert decoded into memory)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    ids = expert_ids.reshape(-1)
    b = blocks[ids]  # [M, N, G, 16]
    c = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:2], -1).to(torch.int32)  # [M, N, K] codes
    e = (c >> 1) & 3  # E2M1: e == 0 -> m / 2; else (1 + m / 2) * 2^(e - 1); bit 3 the sign
    sig = (e > 0).to(torch.float32) + 0.5 * (c & 1).to(torch.float32)
    sig = torch.where((c & 8) != 0, -sig, sig)
    exps = (scales[ids].to(torch.int32) - 127).repeat_interleave(32, dim=-1) + e.clamp(min=1) - 1
    w = torch.ldexp(sig, exps).to(x.dtype)
    return (torch.bmm(w, rows.unsqueeze(-1)).squeeze(-1).reshape(*x.shape[:-1], w.shape[1]),)


# -- attention ------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int, max_bias: float, device=None) -> torch.Tensor:
    """ALiBi's standard slopes, float32 ``[num_heads]`` (as ``plugins/paged_attention/reference.alibi_slopes``):
    head h < n (the largest power of two <= num_heads) has 2^(-max_bias (h + 1) / n), the others the odd-indexed
    slopes of 2n heads."""
    n = 1 << (int(num_heads).bit_length() - 1)
    h = torch.arange(num_heads, dtype=torch.float64)
    e = torch.where(h < n, (h + 1) / n, (2 * (h - n) + 1) / (2 * n))
    return torch.exp2(-float(max_bias) * e).to(torch.float32).to(device)


def paged_attention_torch(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                          k_cache, v_cache, *, num_heads: int, num_kv_heads: int, scale: float,
                          sliding_window: int = 0, softcap: float = 0.0, kv_scales=None,
                          sinks=None, alibi_max_bias: float = 0.0, attention_chunk: int = 0,
                          attend_end=None) -> torch.Tensor:
    """PagedAttention in plain torch (the semantics of ``plugins/paged_attention/reference.py``).

    ``sinks`` ``[num_heads]`` (attention sinks): a logit per query head that joins the softmax's
    denominator and adds nothing to the value sum (a last column of the scores, dropped after it).
    ``alibi_max_bias`` > 0 (ALiBi): ``slope_h * (k_pos - q_pos)`` joins head h's scores (logical positions);
    ``attention_chunk`` = C > 0: a query at position p sees keys ``[floor(p / C) * C, p]``.
    ``attend_end`` ``[T]`` int64 (bidirectional spans): row t at position q also sees keys ``q < k < attend_end[t]``
    (the window / chunk lower bound still applies).

    Writes the new K/V into the caches ``[num_blocks, Hkv, block_size, D]`` in place, then attends
    causally per sequence in float32. Loops over sequences on the host: the CPU executor's kernel,
    and the GPU's fallback where no AOT kernel was built.
    """
    nb, hkv, bs, d = k_cache.shape
    t = query.shape[0]
    fp8 = k_cache.dtype in (torch.uint8, torch.float8_e4m3fn)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kn = key.reshape(t, hkv, d)[keep]
    vn = value.reshape(t, hkv, d)[keep]
    for cache, new, i in ((k_cache, kn, 0), (v_cache, vn, 1)):
        if fp8:
            codes = (new.float() / kv_scales[i]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            store = codes.view(torch.uint8) if cache.dtype == torch.uint8 else codes
        else:
            store = new.to(cache.dtype)
        cache[slots // bs, :, slots % bs, :] = store
    out = torch.zeros((t, num_heads * d), dtype=query.dtype, device=query.device)
    group = num_heads // num_kv_heads
    slopes = alibi_slopes(num_heads, alibi_max_bias, query.device) if alibi_max_bias else None
    qsl = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    for s in range(len(ctxs)):
        start, end, ctx = qsl[s], qsl[s + 1], ctxs[s]
        n_new = end - start
        if n_new == 0:
            continue
        blocks = block_tables[s, : -(-ctx // bs)]
        k = k_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
        v = v_cache[blocks].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
        if fp8:
            k = k.view(torch.float8_e4m3fn).float() * kv_scales[0]
            v = v.view(torch.float8_e4m3fn).float() * kv_scales[1]
        k = k.float().repeat_interleave(group, 0)
        v = v.float().repeat_interleave(group, 0)
        q = query[start:end].reshape(n_new, num_heads, d).float().transpose(0, 1)  # [H, n, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, n, ctx]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(ctx - n_new, ctx, device=query.device).unsqueeze(1)
        kpos = torch.arange(ctx, device=query.device).unsqueeze(0)
        if slopes is not None:
            scores = scores + slopes.reshape(num_heads, 1, 1) * (kpos - qpos).float()
        mask = kpos <= qpos
        if attend_end is not None:  # OR(causal, span) first: the lower bounds below apply to both
            mask = mask | (kpos < attend_end[start:end].unsqueeze(1))
        if sliding_window:
            mask = mask & (kpos > qpos - sliding_window)
        if attention_chunk:
            mask = mask & (kpos >= qpos - qpos % attention_chunk)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            col = sinks.float().reshape(num_heads, 1, 1).expand(num_heads, n_new, 1)
            p = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(p, v).transpose(0, 1).reshape(n_new, num_heads * d).to(query.dtype)
    return out
