"""The CUDA session's versions of program ops that launch an AOT kernel: RMSNorm (+ residual), rotary, SwiGLU (each
optionally emitting an FP8 linear's input), the FP8 and INT4 linears, MXFP4 experts, LoRA.

Each runs the kernel its node names (attribute ``kernel``; the FP8 linear's ``quant_kernel``) where the session
loaded it and the inputs are what the kernel was compiled for, and otherwise the torch op of
:mod:`llmc.runtime.workers.cuda.ops`, which computes the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmc.plugins.fused.requests import INT4_NUM_SMS, INT4_WIDE_SUFFIX, int4_launch
from llmc.plugins.mxfp4 import requests as mxfp4_requests
from llmc.runtime.workers.cuda.ops import OPS, fp8_codes

# rows of the ones that stand for the FP8 linears' per-row activation scale (the scale is folded into the weight's):
# a decode graph of up to this many rows never grows the buffer while it is captured
_ONES_ROWS = 256


class FusedOps:
    """``fused(key)``: the loaded kernel of that key or None; ``launch(kernel, grid, args)`` on the session's stream."""

    def __init__(self, fused: Callable, launch: Callable, dtype: torch.dtype, device: torch.device,
                 num_sms: int = INT4_NUM_SMS) -> None:
        self._fused, self._launch, self.dtype, self.device = fused, launch, dtype, device
        self.num_sms = num_sms  # the device's SMs: the W4A16 kernel's split-K fills them
        self._ones = torch.ones((_ONES_ROWS, 1), dtype=torch.float32, device=device)
        self._old_ones: list[torch.Tensor] = []  # graphs captured before a growth still read these
        self._last_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ids, sorted, permutation

    def overrides(self) -> dict[str, Callable]:
        return {"RMSNormalization": self.rms, "SkipRMSNormalization": self.skip_rms, "RotaryEmbedding": self.rotary,
                "SwiGLU": self.swiglu, "Int4Linear": self.int4_linear, "LoraApply": self.lora,
                "Fp8Linear": self.fp8_linear, "Mxfp4MoEMatMul": self.mxfp4_moe,
                "LayerNormalization": self.layer_norm, "Gelu": self.gelu}

    @staticmethod
    def prepare_fp8_linear(args: list) -> list:
        """An ``Fp8Linear`` node's constants, once at load: the activation scale folded into the weight's per-channel
        scales (``[1, N]`` float32, ``torch._scaled_mm``'s ``scale_b``), which replace them."""
        x, w8, w_scales, act_scale = args[:4]
        if w_scales[0] != "const" or act_scale[0] != "const":
            return args
        return [x, w8, ("const", (w_scales[1].float() * act_scale[1].float()).reshape(1, -1)), act_scale, *args[4:]]

    def _codes_out(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=torch.uint8, device=x.device)

    def rms(self, x, scale, act_scale=None, *, kernel=None, fp8_out=0, **attrs):
        k = self._fused(kernel)
        if k is None or x.dtype != self.dtype:
            return OPS["RMSNormalization"](x, scale, act_scale, **attrs)
        x = x.contiguous()
        rows = x.numel() // x.shape[-1]
        if fp8_out:
            out = self._codes_out(x)
            self._launch(k, (rows, 1, 1), [x, x, scale, act_scale, out, x, rows])
            return (out.view(torch.float8_e4m3fn),)
        out = torch.empty_like(x)
        self._launch(k, (rows, 1, 1), [x, x, scale, out, out, rows])
        return (out,)

    def skip_rms(self, x, skip, scale, act_scale=None, *, kernel=None, fp8_out=0, **attrs):
        k = self._fused(kernel)
        if k is None or x.dtype != self.dtype or skip.dtype != self.dtype:
            return OPS["SkipRMSNormalization"](x, skip, scale, act_scale, **attrs)
        x, skip = x.contiguous(), skip.contiguous()
        total = torch.empty_like(x)
        rows = x.numel() // x.shape[-1]
        if fp8_out:
            out = self._codes_out(x)
            self._launch(k, (rows, 1, 1), [x, skip, scale, act_scale, out, total, rows])
            return out.view(torch.float8_e4m3fn), total
        out = torch.empty_like(x)
        self._launch(k, (rows, 1, 1), [x, skip, scale, out, total, rows])
        return out, total

    def layer_norm(self, x, scale, bias=None, *, kernel=None, **attrs):
        """An encoder's LayerNorm (plugins/fused/encoder_kernels.py) over the last axis."""
        k = self._fused(kernel)
        if k is None or x.dtype != self.dtype or x.shape[-1] != k.info.config["N"]:
            return OPS["LayerNormalization"](x, scale, bias, **attrs)
        x = x.contiguous()
        rows = x.numel() // x.shape[-1]
        out = torch.empty_like(x)
        self._launch(k, (rows, 1, 1), [x, scale, bias if bias is not None else scale, out, rows])
        return (out,)

    def gelu(self, x, *, kernel=None, **attrs):
        """An encoder's GELU, exact or tanh (plugins/fused/encoder_kernels.py)."""
        k = self._fused(kernel)
        if k is None or x.dtype != self.dtype or x.shape[-1] != k.info.config["N"]:
            return OPS["Gelu"](x, **attrs)
        x = x.contiguous()
        rows = x.numel() // x.shape[-1]
        out = torch.empty_like(x)
        self._launch(k, (rows, -(-x.shape[-1] // k.info.config["BLOCK"]), 1), [x, out, rows])
        return (out,)

    def rotary(self, x, cos, sin, position_ids=None, *, kernel=None, **attrs):
        k = self._fused(kernel)
        if (k is None or position_ids is not None or x.dim() == 4 or x.dtype != self.dtype
                or cos.dtype != torch.float32 or sin.dtype != torch.float32):
            return OPS["RotaryEmbedding"](x, cos, sin, position_ids, **attrs)
        x2 = rows_view(x)
        n, heads = x2.shape[0], int(attrs["num_heads"])
        half = x2.shape[1] // heads // 2
        cos, sin = cos.contiguous(), sin.contiguous()
        if cos.numel() != n * half or sin.numel() != n * half:
            return OPS["RotaryEmbedding"](x, cos, sin, position_ids, **attrs)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._launch(k, (n, heads, 1), [x2, cos, sin, out, n, x2.stride(0)])
        return (out,)

    def swiglu(self, gate, up, act_scale=None, *, kernel=None, fp8_out=0, **attrs):
        k = self._fused(kernel)
        if k is None or gate.dtype != self.dtype or up.dtype != self.dtype or gate.shape != up.shape:
            return OPS["SwiGLU"](gate, up, act_scale, **attrs)
        g2, u2 = rows_view(gate), rows_view(up)
        rows, n = g2.shape
        grid = (rows, -(-n // k.info.config["BLOCK"]), 1)
        if fp8_out:
            out = self._codes_out(gate)
            self._launch(k, grid, [g2, u2, act_scale, out, rows, g2.stride(0), u2.stride(0)])
            return (out.view(torch.float8_e4m3fn),)
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        self._launch(k, grid, [g2, u2, out, rows, g2.stride(0), u2.stride(0)])
        return (out,)

    def _ones_rows(self, m: int) -> torch.Tensor:
        if m > self._ones.shape[0]:  # a long prefill (eager): grow, keeping what captured graphs read
            self._old_ones.append(self._ones)
            self._ones = torch.ones((1 << (m - 1).bit_length(), 1), dtype=torch.float32, device=self.device)
        return self._ones[:m]

    def fp8_linear(self, x, w8, ab_scale, act_scale, *, x_fp8=0, quant_kernel=None, **_):
        """``E4M3(x / s) @ w8ᵀ`` scaled by ``ab_scale = s * w_scales`` (prepare_fp8_linear): one ``torch._scaled_mm``
        (cuBLASLt) with unit row scales, after the quantize kernel where the node before did not emit the codes."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x_fp8:
            k = self._fused(quant_kernel)
            if k is None or x.dtype != self.dtype:
                x2 = fp8_codes(x2, act_scale)
            else:
                x2 = rows_view(x2)
                codes = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
                rows, n = x2.shape
                self._launch(k, (rows, -(-n // k.info.config["BLOCK"]), 1), [x2, act_scale, codes, rows, x2.stride(0)])
                x2 = codes.view(torch.float8_e4m3fn)
        m = x2.shape[0]
        y = torch._scaled_mm(x2, w8.t(), scale_a=self._ones_rows(m), scale_b=ab_scale, out_dtype=self.dtype)
        return (y.reshape(*shape[:-1], -1),)

    def int4_linear(self, x, codes, scales, zeros=None, *, kernel=None, **attrs):
        """W4A16 from the packed codes at any row count: the node's "decode" tiling up to its 16 rows, its "wide"
        tiling (``kernel`` + ``INT4_WIDE_SUFFIX``) past them (plugins/fused/requests.py says why two); split-K
        partials (float32) summed here. The torch op (which dequantizes the weight) only where no kernel was built."""
        rows = x.numel() // x.shape[-1]
        k = self._fused(kernel)
        if k is not None and rows > k.info.config["BLOCK_M"]:
            k = self._fused(kernel + INT4_WIDE_SUFFIX)
        if (k is None or x.dtype != self.dtype or scales.dtype != self.dtype
                or (x.shape[-1], codes.shape[1]) != (k.info.config["K"], k.info.config["N"])):  # e.g. a rank's share
            return OPS["Int4Linear"](x, codes, scales, zeros, **attrs)
        x2 = rows_view(x)
        n = codes.shape[1]
        grid, split, chunk = int4_launch(k.info.config, rows, self.num_sms)
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device) if split == 1 else None
        part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device) if split > 1 else None
        self._launch(k, grid, [x2, codes, scales, zeros if zeros is not None else codes,
                               out if out is not None else part, part if part is not None else out,
                               rows, x2.stride(0), split, chunk])
        y = out if part is None else part.sum(0).to(x.dtype)
        return (y.reshape(*x.shape[:-1], n),)

    def mxfp4_moe(self, x, expert_ids, blocks, scales, *, kernel=None, **attrs):
        """Routed rows times their experts' MXFP4 weights by the grouped kernel (plugins/mxfp4/triton_kernel.py):
        the rows sorted by expert id on the device (one ``torch.sort``, shared by the layer's matmuls that route
        the same ids), the codes read once per expert and row block; the node's "decode" tiling, or its "wide" one
        (``kernel`` + ``WIDE_SUFFIX``) once the rows average more than 16 per expert. The torch op (which decodes
        each row's whole expert) where no kernel was built."""
        k = self._fused(kernel)
        rows = x.numel() // x.shape[-1]
        if k is not None and mxfp4_requests.use_wide(rows, blocks.shape[0]):
            k = self._fused(kernel + mxfp4_requests.WIDE_SUFFIX)
        if (k is None or x.dtype != self.dtype or rows == 0 or expert_ids.numel() != rows
                or (blocks.shape[0], blocks.shape[1], x.shape[-1]) != (k.info.config["E"], k.info.config["N"],
                                                                        k.info.config["K"])):
            return OPS["Mxfp4MoEMatMul"](x, expert_ids, blocks, scales, **attrs)
        x2 = rows_view(x)
        sorted_ids, order = self._sorted_ids(expert_ids)
        n = blocks.shape[1]
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        self._launch(k, mxfp4_requests.moe_launch(k.info.config, rows),
                     [x2, sorted_ids, order, blocks, scales, out, rows, x2.stride(0), rows.bit_length()])
        return (out.reshape(*x.shape[:-1], n),)

    def _sorted_ids(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # gpt-oss's gate/up and down projections route the same ids tensor: sorted once (kept while it is the last)
        if self._last_ids is None or self._last_ids[0] is not expert_ids:
            self._last_ids = (expert_ids, *torch.sort(expert_ids.reshape(-1)))
        return self._last_ids[1], self._last_ids[2]

    def lora(self, y, x, a, b, slots, *, shrink_kernel=None, expand_kernel=None, **attrs):
        ks, ke = self._fused(shrink_kernel), self._fused(expand_kernel)
        if ks is None or ke is None or {x.dtype, y.dtype, a.dtype, b.dtype} != {self.dtype}:
            return OPS["LoraApply"](y, x, a, b, slots, **attrs)
        x2, y2 = rows_view(x), rows_view(y)
        t, n, rank = x2.shape[0], y2.shape[1], int(attrs["rank"])
        u = torch.empty((t, rank), dtype=torch.float32, device=x.device)
        self._launch(ks, (t, 1, 1), [x2, a, slots, u, t, x2.stride(0)])
        out = torch.empty((t, n), dtype=y.dtype, device=y.device)
        self._launch(ke, (t, -(-n // ke.info.config["BLOCK_N"]), 1), [u, b, slots, y2, out, t, y2.stride(0)])
        return (out.reshape(y.shape),)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """A ``[rows, n]`` view of ``t`` with unit inner stride, copying only where it must."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
