"""CUDA backend: the fused graph as a torch program with ahead-of-time kernels, for llmc's CUDA engine.

``emit`` writes into the artifact:

- ``program.json``: the graph after the passes (and quantization) as a flat node list
  (:mod:`llmc.runtime.workers.cuda.program` defines the format and executes it);
- ``weights.safetensors``: every weight in the layout its op reads, streamed one tensor at a time:
  float weights in the engine dtype (``bfloat16`` by default; ``float32`` for exact parity tests),
  FP8 linears as E4M3 ``[N, K]`` + per-channel scales (``torch._scaled_mm``'s operand), INT4 linears
  as two codes per byte ``[ceil(K/2), N]`` + group scales (+ zero points);
- ``kernels/*.cubin``: the Triton kernels compiled for the target SM on this machine (no GPU needed): per distinct
  attention configuration the flash prefill, split-KV decode and reduce kernels (the first PagedAttention kernel's
  decode and prefill specialisations for heads past 256), and the fused kernels the nodes name; their launch
  metadata goes to the manifest (``engine.kernels``).

Precision: values computed from the token ids (activations) run in the engine dtype, everything
else that the graph derives from positions and constants (rotary angles) stays float32, as in a
transformers model loaded in bfloat16. Lowering fusions (``Fp8Linear``, ``Int4Linear``) replace the
Q/DQ patterns the quantize pass writes.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from llmc.errors import UnsupportedError
from llmc.runtime.workers.cuda import program as torch_program
from llmc.runtime.workers.cuda.session import attention_key

ENGINE_DTYPES = ("bfloat16", "float16", "float32")
KERNEL_DIR = "kernels"
_TL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "u8"}  # u8: FP8 E4M3 codes
_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32", "int8": "I8",
       "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3"}
_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}
_IR_TO_NAME = {ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16",
               ir.DataType.INT64: "int64", ir.DataType.INT32: "int32", ir.DataType.INT8: "int8",
               ir.DataType.UINT8: "uint8", ir.DataType.BOOL: "bool", ir.DataType.FLOAT8E4M3FN: "float8_e4m3fn",
               # 4-bit codes outside a fused linear: one code per byte (DequantizeLinear reads them as integers)
               ir.DataType.INT4: "int8", ir.DataType.UINT4: "uint8"}
_FLOATS = {"float32", "float16", "bfloat16"}
_ST_TO_TL = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
# Inputs that keep their stored precision even where activations meet them (scales, zero points).
_KEEP_PRECISION = {"QuantizeLinear": (1, 2), "DequantizeLinear": (1, 2)}


@dataclass
class _Weight:
    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    produce: Callable[[], bytes]


def _bytes(array: np.ndarray, dtype: str) -> bytes:
    """``array`` (numpy, any float/int type incl. ml_dtypes) converted to the program dtype ``dtype``."""
    import torch

    if dtype == "float8_e4m3fn":
        return np.ascontiguousarray(array).view(np.uint8).tobytes()
    if dtype == "bfloat16":
        t = torch.from_numpy(np.array(array, dtype=np.float32)).to(torch.bfloat16)  # a copy: weights may be read-only
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()  # reshape: a 0-D scalar cannot be viewed
    return np.ascontiguousarray(array, dtype=np.dtype(dtype)).tobytes()


def write_safetensors(path: Path, weights: list[_Weight]) -> None:
    """Stream ``weights`` into a safetensors file: the header from shapes alone, then one tensor at a time."""
    header, offset = {}, 0
    for w in weights:
        n = int(np.prod(w.shape, dtype=np.int64)) * _SIZE[w.dtype]
        header[w.name] = {"dtype": w.dtype, "shape": list(w.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for w in weights:
            data = w.produce()
            want = header[w.name]["data_offsets"]
            if len(data) != want[1] - want[0]:
                raise RuntimeError(f"weight {w.name}: {len(data)} bytes, header says {want[1] - want[0]}")
            f.write(data)


def _attr(value):
    if isinstance(value, tuple | list):
        return [_attr(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "numpy") or isinstance(value, ir.Graph):  # tensor / graph attributes
        raise TypeError("tensor attribute")
    return value


def _activations(graph: ir.Graph, roots: frozenset[str] | None = None) -> set[int]:
    """ids of the values computed from the token ids (the activation path); ``roots``: the graph inputs the path
    starts from instead (an encoder's pixels)."""
    act = {id(v) for v in graph.inputs if v.name in (roots or {"input_ids"})}
    for node in graph:
        if any(v is not None and id(v) in act for v in node.inputs):
            act.update(id(o) for o in node.outputs)
    return act


def _const(v: ir.Value | None) -> ir.TensorProtocol | None:
    return None if v is None else v.const_value


def _producer(v: ir.Value | None, op: str) -> ir.Node | None:
    if v is None or v.producer() is None or v.producer().op_type != op:
        return None
    return v.producer()


def _match_lora(node: ir.Node) -> tuple | None:
    """llmc.passes.lora's slot update ``Add(y, MatMul(Mul(MatMul(x, A), mask), B))``, A and B graph inputs ->
    (y, x, A, B, the mask's Cast, slots, rank)."""
    if node.op_type != "Add" or node.domain != "" or len(node.inputs) != 2:
        return None
    y, d = node.inputs
    expand = _producer(d, "MatMul")
    keep = _producer(expand.inputs[0], "Mul") if expand is not None else None
    shrink = _producer(keep.inputs[0], "MatMul") if keep is not None else None
    if shrink is None or not expand.inputs[1].name.endswith(".lora_B") or not shrink.inputs[1].name.endswith(
            ".lora_A") or expand.inputs[1].producer() is not None or shrink.inputs[1].producer() is not None:
        return None
    cast = _producer(keep.inputs[1], "Cast")
    equal = _producer(cast.inputs[0], "Equal") if cast is not None else None
    owner = _const(equal.inputs[1]) if equal is not None else None
    unsq = _producer(equal.inputs[0], "Unsqueeze") if equal is not None else None
    if owner is None or unsq is None or unsq.inputs[0].producer() is not None:
        return None
    rank = int((owner.numpy() == 1).sum())
    return y, shrink.inputs[0], shrink.inputs[1], expand.inputs[1], cast, unsq.inputs[0], rank


def _match_fp8_linear(node: ir.Node) -> tuple | None:
    """``MatMul(DQ(Q(x, s)), DQ(w8 [K, N], ws [N], axis=1))`` -> (x, s, w8, ws)."""
    a, b = node.inputs
    dqw, dqa = _producer(b, "DequantizeLinear"), _producer(a, "DequantizeLinear")
    if dqw is None or dqa is None or dqw.attributes.get_int("axis", 1) != 1:
        return None
    w8, ws = dqw.inputs[0], dqw.inputs[1]
    if _const(w8) is None or w8.dtype != ir.DataType.FLOAT8E4M3FN or _const(ws) is None:
        return None
    q = _producer(dqa.inputs[0], "QuantizeLinear")
    if q is None or _const(q.inputs[1]) is None or q.inputs[1] is not dqa.inputs[1]:
        return None
    if len(w8.shape) != 2 or len(ws.shape) != 1:
        return None
    return q.inputs[0], q.inputs[1], w8, ws


def _match_fp8_qdq(v: ir.Value | None) -> tuple[ir.Value, float] | None:
    """``DQ(Q(x, s, zp), s, zp)`` to E4M3 with one static scale ``s`` (the quantize pass's FP8 KV cache) ->
    (x, s)."""
    dq = _producer(v, "DequantizeLinear")
    q = _producer(dq.inputs[0], "QuantizeLinear") if dq is not None else None
    if q is None or len(q.inputs) < 3 or q.inputs[2] is None or q.inputs[2].dtype != ir.DataType.FLOAT8E4M3FN:
        return None
    scale = _const(q.inputs[1])
    if scale is None or scale.numpy().size != 1 or _const(dq.inputs[1]) is None:
        return None
    if float(_const(dq.inputs[1]).numpy().reshape(-1)[0]) != float(scale.numpy().reshape(-1)[0]):
        return None
    if q.attributes.get_int("saturate", 1) != 1 or q.attributes.get_int("axis", 1) not in (0, 1):
        return None
    return q.inputs[0], float(scale.numpy().reshape(-1)[0])


def _match_int4_linear(node: ir.Node) -> tuple | None:
    """``MatMul(x, DQ(codes [K, N] int4/uint4, scales [K/g, N], [zp], axis=0, block_size=g))``."""
    x, b = node.inputs
    dq = _producer(b, "DequantizeLinear")
    if dq is None or dq.attributes.get_int("axis", 1) != 0 or not dq.attributes.get_int("block_size", 0):
        return None
    codes = dq.inputs[0]
    if _const(codes) is None or codes.dtype not in (ir.DataType.INT4, ir.DataType.UINT4):
        return None
    zp = dq.inputs[2] if len(dq.inputs) > 2 else None
    return x, codes, dq.inputs[1], zp, dq.attributes.get_int("block_size", 0)


_FP8_EMITTERS = ("RMSNormalization", "SkipRMSNormalization", "SwiGLU")


def _user(use) -> ir.Node:
    return use.node if hasattr(use, "node") else use[0]


def _pack_int4(codes: np.ndarray) -> np.ndarray:
    """``[K, N]`` 4-bit codes (int4 -8..7 or uint4 0..15) -> ``[ceil(K/2), N]`` uint8, row 2i in the low nibble."""
    c = codes.astype(np.int16) & 0x0F
    if c.shape[0] % 2:
        c = np.concatenate([c, np.zeros((1, c.shape[1]), np.int16)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


class _Lowering:
    def __init__(self, model: ir.Model, dtype: str, roots: frozenset[str] | None = None) -> None:
        self.graph = model.graph
        self.dtype = dtype
        self.act = _activations(self.graph, roots)
        self.nodes: list[dict] = []
        self.weights: dict[str, _Weight] = {}
        self.fusions = {"fp8-linear": 0, "int4-linear": 0}
        self.fused: set[int] = set()  # ids of the MatMul nodes a lowering fusion replaced
        # ids of PagedAttention nodes whose K and V pass through FP8 Q/DQ -> ((k, k_scale), (v, v_scale)):
        # the cache itself stores E4M3 codes with those scales (the kernels quantize on write).
        self.kv_fp8: dict[int, tuple] = {}
        self.kernel_requests: dict[str, dict] = {}  # fused-kernel key -> AOT request (llmc.plugins.triton_aot)
        # FP8 linears' inputs quantized by the node that produces them: that node's id -> the activation scale, and
        # the ids of the MatMuls fed that way (_fp8_emitters)
        self.fp8_emitters: dict[int, ir.Value] = {}
        self.fp8_fed: set[int] = set()

    # weights ------------------------------------------------------------------------------------

    def weight(self, v: ir.Value, dtype: str | None = None) -> str:
        """Record initializer ``v`` in ``dtype`` (default: its own) and return its name."""
        name = v.name
        stored = dtype or _IR_TO_NAME.get(v.dtype)
        if stored is None:
            raise UnsupportedError(f"the CUDA backend cannot store weight {name!r} of type {v.dtype}")
        key = name if name not in self.weights or self.weights[name].dtype == _ST[stored] else f"{name}:{stored}"
        if key not in self.weights:
            tensor = v.const_value
            shape = tuple(int(d) for d in tensor.shape)
            self.weights[key] = _Weight(key, _ST[stored], shape, lambda t=tensor, s=stored: _bytes(t.numpy(), s))
        return key

    def derived(self, name: str, dtype: str, shape: tuple[int, ...], produce: Callable[[], np.ndarray]) -> str:
        self.weights[name] = _Weight(name, _ST[dtype], shape, lambda: _bytes(produce(), dtype))
        return name

    # nodes --------------------------------------------------------------------------------------

    def emit(self, op: str, inputs: list[str], outputs: list[str], attrs: dict | None = None) -> None:
        self.nodes.append({"op": op, "inputs": inputs, "outputs": outputs, "attrs": attrs or {}})

    def input_name(self, node: ir.Node, i: int, v: ir.Value | None) -> str:
        if v is None:
            return ""
        if v.const_value is not None and v.producer() is None:
            is_float = _IR_TO_NAME.get(v.dtype) in _FLOATS
            meets_act = any(u is not None and id(u) in self.act for u in node.inputs)
            if is_float and meets_act and i not in _KEEP_PRECISION.get(node.op_type, ()):
                return self.weight(v, self.dtype)
            return self.weight(v)
        return v.name

    def lower(self) -> None:
        # Fused nodes are emitted where the MatMul stood, so the node order stays topological.
        for node in self.graph:
            if node.op_type == "MatMul" and node.domain == "" and (_match_fp8_linear(node) or
                                                                  _match_int4_linear(node)):
                self.fused.add(id(node))
            elif node.op_type == torch_program.ATTENTION_OP:
                kv = (_match_fp8_qdq(node.inputs[1]), _match_fp8_qdq(node.inputs[2]))
                if all(kv):
                    self.kv_fp8[id(node)] = kv
        layers = sum(1 for n in self.graph if n.op_type == torch_program.ATTENTION_OP)
        if self.kv_fp8 and len(self.kv_fp8) != layers:  # one pool, one format: every layer or none
            raise UnsupportedError(f"the CUDA engine needs an FP8 KV cache in every attention layer or none "
                                   f"({len(self.kv_fp8)} of {layers} have one)")
        self._fp8_emitters()
        dead = self._dead_after_fusion()
        lora = self._lora_sites(dead)
        # Hybrid models: their shape arithmetic becomes constants (llmc.compiler.backends.cuda_fold says why; kept to
        # them for now: a --tp build's sharding rewrites shapes that must stay computed).
        folder = None
        if any(n.op_type in torch_program.STATE_OPS for n in self.graph):
            from llmc.compiler.backends.cuda_fold import ShapeFolder

            folder = ShapeFolder()
        for node in self.graph:
            if id(node) in dead:
                continue
            if folder is not None and (folded := folder.fold(node)) is not None:
                for name, value in folded.items():
                    self.derived(name, "int64", value.shape, lambda v=value: v)
                self.fusions["folded-shape-ops"] = self.fusions.get("folded-shape-ops", 0) + 1
                continue
            if id(node) in lora:
                self._emit_lora(node, lora[id(node)])
            elif id(node) in self.fused:
                self._fuse_linear(node)
            else:
                self._generic(node)

    def _fuse_linear(self, node: ir.Node) -> bool:
        m = _match_fp8_linear(node)
        if m is not None:
            x, s, w8, ws = m
            k, n = (int(d) for d in w8.shape)
            t = _const(w8)
            w_name = self.derived(f"{w8.name}.nk", "float8_e4m3fn", (n, k),
                                  lambda t=t: np.ascontiguousarray(t.numpy().T))
            attrs = {"mode": "scaled_mm"}
            if id(node) in self.fp8_fed:  # x arrives as E4M3 codes: the output's dtype is the engine's
                attrs.update(x_fp8=1, dtype=self.dtype)
            else:  # one kernel quantizes x on a GPU (the session's Fp8Linear)
                from llmc.plugins.fused import requests as fk

                req = fk.fp8_quantize_request(k, _TL[self.dtype])
                self.kernel_requests[req["key"]] = req
                attrs["quant_kernel"] = req["key"]
            self.emit("Fp8Linear", [x.name, w_name, self.weight(ws, "float32"), self.weight(s, "float32")],
                      [node.outputs[0].name], attrs)
            self.fusions["fp8-linear"] += 1
            return True
        m = _match_int4_linear(node)
        if m is not None:
            x, codes, scales, zp, g = m
            k, n = (int(d) for d in codes.shape)
            ct = _const(codes)
            packed = self.derived(f"{codes.name}.packed", "uint8", ((k + 1) // 2, n),
                                  lambda ct=ct: _pack_int4(ct.numpy()))
            inputs = [x.name, packed, self.weight(scales, self.dtype)]
            if zp is not None:
                zt = _const(zp)
                inputs.append(self.derived(f"{zp.name}.u8", "uint8", tuple(int(d) for d in zp.shape),
                                           lambda zt=zt: zt.numpy().astype(np.uint8)))
            attrs = {"group_size": g, "k": k}
            if g % min(g, 128) == 0 and min(g, 128) >= 16:  # the W4A16 kernel's tiling (else: torch dequantizes)
                from llmc.plugins.fused import requests as fk

                for wide in (False, True):  # decode rows, and more (the session picks by the rows of each call)
                    req = fk.int4_matmul_request(n, k, g, zp is not None, _TL[self.dtype], wide=wide)
                    self.kernel_requests[req["key"]] = req
                attrs["kernel"] = req["key"].removesuffix(fk.INT4_WIDE_SUFFIX)
            self.emit("Int4Linear", inputs, [node.outputs[0].name], attrs)
            self.fusions["int4-linear"] += 1
            return True
        return False

    def _fp8_emitters(self) -> None:
        """Fill ``fp8_emitters`` / ``fp8_fed``: an RMSNorm, skip-RMSNorm or SwiGLU whose output's only reader is the
        ``QuantizeLinear`` of FP8 linears (all fused, one static scale) emits the E4M3 codes itself (its kernel
        quantizes as it writes), and those linears take the codes."""
        for node in self.graph:
            if node.op_type not in _FP8_EMITTERS or not node.outputs:
                continue
            uses = [_user(u) for u in node.outputs[0].uses()]
            if len(uses) != 1 or uses[0].op_type != "QuantizeLinear" or uses[0].inputs[0] is not node.outputs[0]:
                continue
            q = uses[0]
            mats = [_user(m) for dq in q.outputs[0].uses() for m in _user(dq).outputs[0].uses()]
            if not mats or not all(id(m) in self.fused and (f := _match_fp8_linear(m)) is not None
                                   and f[0] is node.outputs[0] for m in mats):
                continue
            self.fp8_emitters[id(node)] = q.inputs[1]
            self.fp8_fed.update(id(m) for m in mats)

    def _lora_sites(self, dead: set[int]) -> dict[int, tuple]:
        """LoRA slot updates (llmc.passes.lora) -> one ``LoraApply`` node each (the shrink/expand kernels on a
        GPU); their MatMuls and Mul, and the slot mask once no other node reads it, join ``dead``."""
        nodes = {id(n): n for n in self.graph}
        sites = {i: m for i, n in nodes.items() if (m := _match_lora(n)) is not None}
        masks = {}
        for add_id, (_, _, _, _, cast, _, _) in sites.items():
            expand = nodes[add_id].inputs[1].producer()
            keep = expand.inputs[0].producer()
            dead.update({id(expand), id(keep), id(keep.inputs[0].producer())})
            masks[id(cast)] = cast
        for cast in masks.values():
            if all(id(u.node) in dead for u in cast.outputs[0].uses()):
                equal = cast.inputs[0].producer()
                dead.update({id(cast), id(equal)})
                if all(id(u.node) in dead for u in equal.inputs[0].uses()):
                    dead.add(id(equal.inputs[0].producer()))
        return sites

    def _emit_lora(self, node: ir.Node, match: tuple) -> None:
        y, x, a, b, _, slots, rank = match
        k, width = (int(d) for d in a.shape)
        n = int(b.shape[1])
        from llmc.plugins.lora import requests as lk

        shrink = lk.shrink_request(k, rank, width // rank, _TL[self.dtype])
        expand = lk.expand_request(n, rank, width // rank, _TL[self.dtype])
        self.kernel_requests[shrink["key"]] = shrink
        self.kernel_requests[expand["key"]] = expand
        self.emit("LoraApply", [y.name, x.name, a.name, b.name, slots.name], [node.outputs[0].name],
                  {"rank": rank, "shrink_kernel": shrink["key"], "expand_kernel": expand["key"]})
        self.fusions["lora"] = self.fusions.get("lora", 0) + 1

    def _dead_after_fusion(self) -> set[int]:
        """Q/DQ nodes whose every consumer was fused away."""
        dead: set[int] = set()
        changed = True
        while changed:
            changed = False
            for node in self.graph:
                if id(node) in dead or node.op_type not in ("DequantizeLinear", "QuantizeLinear"):
                    continue
                users = [u.node if hasattr(u, "node") else u[0] for o in node.outputs for u in o.uses()]
                if users and all(id(u) in self.fused or id(u) in dead or id(u) in self.kv_fp8 for u in users):
                    dead.add(id(node))
                    changed = True
        return dead

    def _generic(self, node: ir.Node) -> None:
        op = node.op_type
        if op == "CastLike" and node.inputs[1] is not None and node.inputs[1].dtype in _IR_TO_NAME:
            # the type it casts to is known here: a Cast (an activation's follows the engine dtype, as Cast's does)
            like = node.inputs[1]
            to = self.dtype if id(like) in self.act and _IR_TO_NAME[like.dtype] in _FLOATS else \
                _IR_TO_NAME[like.dtype]
            self.emit("Cast", [self.input_name(node, 0, node.inputs[0])], [node.outputs[0].name], {"to": to})
            return
        if op not in torch_program.supported_ops():
            raise UnsupportedError(f"the CUDA engine has no kernel for operator {node.domain or 'ai.onnx'}."
                                   f"{op} (node {node.name}); build this model with --target cpu")
        attrs = {}
        for name, a in node.attributes.items():
            if op == "ConstantOfShape" and name == "value":  # a one-element tensor: its value and type
                t = a.value.numpy().reshape(-1)
                attrs.update(value=[t[0].item()], dtype=_IR_TO_NAME[a.value.dtype])
                continue
            try:
                attrs[name] = _attr(a.value)
            except TypeError:
                raise UnsupportedError(f"the CUDA backend cannot lower {op} node {node.name}: tensor attribute "
                                       f"{name!r}") from None
        if op == "Cast":
            to = ir.DataType(attrs["to"])
            name = _IR_TO_NAME.get(to)
            if name is None:
                raise UnsupportedError(f"the CUDA backend cannot Cast to {to} (node {node.name})")
            if name == "float32" and node.inputs[0] is not None and id(node.inputs[0]) in self.act:
                name = self.dtype
            attrs["to"] = name
        inputs = [self.input_name(node, i, v) for i, v in enumerate(node.inputs)]
        if op == torch_program.ATTENTION_OP and len(node.inputs) > 7 and node.inputs[7] is not None:
            # Attention sinks: float32 logits [num_heads], what the attention kernels read.
            sinks = node.inputs[7]
            if sinks.const_value is None or sinks.producer() is not None:
                raise UnsupportedError(f"the CUDA backend lowers attention sinks held as a weight only (node "
                                       f"{node.name} computes them)")
            inputs[7] = self.weight(sinks, "float32")
            attrs["has_sinks"] = 1
        if op == torch_program.ATTENTION_OP and len(node.inputs) > 8 and node.inputs[8] is not None:
            # Bidirectional spans (attend_end [T] int64, the step's graph input): the kernels built for them read it.
            attrs["has_attend_end"] = 1
        if id(node) in self.kv_fp8:
            (k, k_scale), (v, v_scale) = self.kv_fp8[id(node)]
            inputs[1], inputs[2] = k.name, v.name
            attrs.update(k_scale=k_scale, v_scale=v_scale)
        if id(node) in self.fp8_emitters:  # its output leaves as its FP8 linear's codes (scale: the last input)
            inputs.append(self.weight(self.fp8_emitters[id(node)], "float32"))
            attrs["fp8_out"] = 1
        key = self._fused_kernel(node, inputs, attrs)
        if key is not None:
            attrs["kernel"] = key
        self.emit(op, inputs, [o.name for o in node.outputs], attrs)

    def _fused_kernel(self, node: ir.Node, inputs: list[str], attrs: dict) -> str | None:
        """The fused Triton kernel (key) that runs this node on a GPU, recording its AOT request; None: torch."""
        from llmc.plugins.fused import requests as fk

        op, act = node.op_type, _TL[self.dtype]
        last = node.inputs[0].shape[-1] if node.inputs and node.inputs[0] is not None and node.inputs[0].shape \
            else None
        if not isinstance(last, int):
            return None
        if op in ("RMSNormalization", "SkipRMSNormalization"):
            if attrs.get("axis", -1) not in (-1, len(node.inputs[0].shape) - 1):
                return None
            scale = inputs[2 if op == "SkipRMSNormalization" else 1]
            w = self.weights.get(scale)
            if w is None:
                return None
            make = fk.rms_norm_fp8_request if attrs.get("fp8_out") else fk.rms_norm_request
            req = make(last, float(attrs.get("epsilon", 1e-5)), op == "SkipRMSNormalization", act, _ST_TO_TL[w.dtype])
        elif op == "RotaryEmbedding":
            heads = int(attrs.get("num_heads", 0))
            if (attrs.get("interleaved", 0) or not heads or last % heads or len(node.inputs) > 3
                    or len(node.inputs[0].shape) == 4  # [B, H, T, D]: the kernel reads [tokens, H*D] rows
                    or attrs.get("rotary_embedding_dim", 0) not in (0, last // heads)):
                return None
            req = fk.rotary_request(heads, last // heads, act)
        elif op == "SwiGLU":
            req = (fk.swiglu_fp8_request if attrs.get("fp8_out") else fk.swiglu_request)(last, act)
        elif op == "Mxfp4MoEMatMul":  # MXFP4 experts: the grouped kernel over the stored codes (plugins/mxfp4)
            from llmc.plugins.mxfp4 import requests as mk

            blocks = self.weights.get(inputs[2])
            if blocks is None or len(blocks.shape) != 4 or blocks.shape[2] * 32 != last:
                return None
            for wide in (False, True):  # few rows per expert (decode), and many (prefill): the session picks
                req = mk.moe_request(blocks.shape[0], blocks.shape[1], last, act, wide=wide)
                self.kernel_requests[req["key"]] = req
            return req["key"].removesuffix(mk.WIDE_SUFFIX)
        elif op in torch_program.STATE_OPS:
            req = _recurrent_request(node, attrs, act)
            if req is None:
                return None
        else:
            return None
        self.kernel_requests[req["key"]] = req
        return req["key"]


def _recurrent_request(node: ir.Node, attrs: dict, act: str) -> dict | None:
    """The AOT request of a recurrent-state op's Triton kernel (llmc.plugins.recurrent.requests), from the widths
    of its inputs; None where a width is not static (the op then runs its torch reference)."""
    from llmc.plugins.recurrent import CONV_OP_TYPE, DELTA_OP_TYPE
    from llmc.plugins.recurrent import requests as rk

    def width(i: int) -> int | None:
        v = node.inputs[i] if i < len(node.inputs) else None
        d = v.shape[-1] if v is not None and v.shape is not None and len(v.shape) else None
        return d if isinstance(d, int) else None

    if node.op_type == CONV_OP_TYPE:
        w = node.inputs[1]
        taps = w.shape[-1] if w is not None and w.shape is not None and len(w.shape) == 2 else None
        if width(0) is None or not isinstance(taps, int):
            return None
        bias = len(node.inputs) > 2 and node.inputs[2] is not None
        return rk.conv_request(width(0), taps, bias, int(attrs.get("activation", 0)) == 1, act)
    if node.op_type == DELTA_OP_TYPE:
        hk, hv = int(attrs["num_k_heads"]), int(attrs["num_v_heads"])
        if width(0) is None or width(2) is None:
            return None
        return rk.delta_request(hk, hv, width(0) // hk, width(2) // hv, bool(attrs.get("use_qk_l2norm", 1)), act)
    h, g = int(attrs["num_heads"]), int(attrs["n_groups"])
    if width(0) is None or width(1) is None:
        return None
    return rk.ssd_request(h, g, width(0) // h, width(1) // g, float(attrs.get("dt_min", 0.0)),
                          float(attrs.get("dt_max", float("inf"))), act)


@dataclass
class CudaEngineFiles:
    program: str
    weights: str
    kernels: list[dict]
    fusions: dict[str, int]
    dtype: str
    kv_cache_dtype: str  # what the KV pool stores: the engine dtype, or float8_e4m3fn codes
    parallel: dict | None = None  # --tp N: the manifest's ``parallel`` section (rank files, heads per rank)


def attention_configs(nodes: list[dict]) -> dict[str, dict]:
    """The distinct attention configurations of a program (key -> attributes)."""
    return {attention_key(n["attrs"]): n["attrs"] for n in nodes if n["op"] == torch_program.ATTENTION_OP}


def compile_kernels(configs: dict[str, dict], sm: int, dtype: str, cache_dtype: str, block_size: int,
                    out_dir: Path, fused: dict[str, dict] | None = None) -> list[dict]:
    """AOT-compile each attention configuration's kernels into cubins, and the ``fused`` requests (RMSNorm, rotary,
    SwiGLU, linears: :func:`compile_fused`) with them, in one compiler process.

    Attention: the flash kernels (plugins/paged_attention/flash.py: FlashAttention-2-style prefill, split-KV decode
    and its reduce; manifest variants ``flash-prefill``/``flash-decode``/``flash-reduce``) for every configuration
    whose head size they take (up to ``flash_requests.MAX_HEAD_SIZE``); the first kernel (triton_kernel.py, variants
    ``decode``/``prefill``) for larger heads only."""
    from llmc.plugins.paged_attention import aot
    from llmc.plugins.paged_attention import flash_requests as fr
    from llmc.plugins.paged_attention.triton_kernel import KernelConfig

    plan = []
    flash = []
    for key, a in sorted(configs.items()):
        if int(a["head_size"]) <= fr.MAX_HEAD_SIZE:
            flash += fr.requests(key, a, act=_TL[dtype], cache=_TL[cache_dtype], block_size=block_size,
                                 fp8_native=sm >= 89).values()
            continue
        for variant, block_m in (("decode", 16), ("prefill", 64)):
            cfg = KernelConfig(num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"], head_size=a["head_size"],
                               block_size=block_size, scale=float(a["scale"]), act_dtype=_TL[dtype],
                               cache_dtype=_TL[cache_dtype], sliding_window=int(a.get("sliding_window", 0)),
                               softcap=float(a.get("softcap", 0.0)), block_m=block_m, block_n=64,
                               sinks=bool(a.get("has_sinks", 0)),
                               alibi_max_bias=float(a.get("alibi_max_bias", 0.0)),
                               attention_chunk=int(a.get("attention_chunk", 0)),
                               attend_end=bool(a.get("has_attend_end", 0)))
            plan.append((key, variant, cfg))
    compiled = aot.compile_many([cfg for _, _, cfg in plan], sm)
    (out_dir / KERNEL_DIR).mkdir(exist_ok=True)
    entries = []
    for i, ((key, variant, _), k) in enumerate(zip(plan, compiled, strict=True)):
        file = f"{KERNEL_DIR}/paged_attention_{i}_{variant}.sm{sm}.cubin"
        (out_dir / file).write_bytes(aot.assemble(k.ptx, sm))
        entries.append({"name": k.name, "file": file, "sm": sm, "target": k.target, "num_warps": k.num_warps,
                        "shared_mem": k.shared_mem, "block_q": k.block_q, "num_kv_heads": k.num_kv_heads,
                        "variant": variant, "key": key, "params": list(k.params), "grid_rule": k.grid_rule,
                        "config": {c: v for c, v in k.config.items() if c not in ("interpret",)}})
    fused_plan = sorted((fused or {}).items())
    every = [r for _, r in fused_plan] + flash
    from llmc.plugins import triton_aot

    done = triton_aot.compile_requests(every, sm) if every else []
    entries += _fused_entries(fused_plan, done[: len(fused_plan)], sm, out_dir)
    for j, (req, k) in enumerate(zip(flash, done[len(fused_plan):], strict=True)):
        file = f"{KERNEL_DIR}/{req['fn']}_{j}.sm{sm}.cubin"
        (out_dir / file).write_bytes(aot.assemble(k["ptx"], sm))
        const = req["constexprs"]
        entries.append({"name": k["name"], "file": file, "sm": sm, "target": k["target"], "num_warps": k["num_warps"],
                        "shared_mem": k["shared_mem"], "block_q": int(const.get("BLOCK_Q", 0)),
                        "num_kv_heads": int(configs[req["key"]]["num_kv_heads"]), "variant": req["variant"],
                        "key": req["key"], "op": req["op"], "module": req["module"], "fn": req["fn"],
                        "params": fr.params(req), "grid_rule": req["grid_rule"], "config": const})
    return entries


def compile_fused(requests: dict[str, dict], sm: int, out_dir: Path) -> list[dict]:
    """AOT-compile the fused kernels (RMSNorm, rotary, SwiGLU) a program's nodes name into cubins."""
    from llmc.plugins import triton_aot

    plan = sorted(requests.items())
    return _fused_entries(plan, triton_aot.compile_requests([r for _, r in plan], sm), sm, out_dir)


def _fused_entries(plan: list[tuple[str, dict]], compiled: list[dict], sm: int, out_dir: Path) -> list[dict]:
    from llmc.plugins.paged_attention import aot

    (out_dir / KERNEL_DIR).mkdir(exist_ok=True)
    entries = []
    for i, ((key, req), k) in enumerate(zip(plan, compiled, strict=True)):
        file = f"{KERNEL_DIR}/{req['fn']}_{i}.sm{sm}.cubin"
        (out_dir / file).write_bytes(aot.assemble(k["ptx"], sm))
        entries.append({"name": k["name"], "file": file, "sm": sm, "target": k["target"], "num_warps": k["num_warps"],
                        "shared_mem": k["shared_mem"], "block_q": 0, "num_kv_heads": 0, "variant": "fused",
                        "key": key, "op": req["op"], "module": req["module"], "fn": req["fn"],
                        "params": [n for n, t in req["signature"].items() if t != "constexpr"],
                        "grid_rule": req["grid_rule"], "config": req["constexprs"]})
    return entries


def _node_key(request_key: str) -> str:
    """The node ``kernel`` attribute a request serves (a second tiling of a node's kernel carries a suffix)."""
    from llmc.plugins.fused.requests import INT4_WIDE_SUFFIX
    from llmc.plugins.mxfp4.requests import WIDE_SUFFIX

    return request_key.removesuffix(INT4_WIDE_SUFFIX).removesuffix(WIDE_SUFFIX)


def ptxas_cuda_version(sm: int) -> str | None:
    """The CUDA release of the ``ptxas`` that assembles the cubins (the driver must support its major version)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        out = subprocess.run([get_ptxas(sm).path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except Exception:  # noqa: BLE001 - no Triton here: no cubins either, reported by the caller
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def emit(model: ir.Model, out_dir: Path, *, sm: int, dtype: str = "bfloat16", block_size: int = 16,
         say: Callable[[str], None] | None = None, aot: bool = True, tp: int = 1,
         ep: bool = False) -> CudaEngineFiles:
    """Lower ``model`` and write the CUDA engine's files into ``out_dir`` (``tp`` > 1: one program and one
    weights file per rank, ``rank<r>/``, split by :mod:`llmc.compiler.sharding`; ``ep``: MoE experts placed whole
    on the ranks instead of split)."""
    if dtype not in ENGINE_DTYPES:
        raise UnsupportedError(f"--dtype {dtype}: the CUDA engine computes in one of {', '.join(ENGINE_DTYPES)}")
    say = say or (lambda msg: None)
    low = _Lowering(model, dtype)
    low.lower()
    outputs = [v.name for v in model.graph.outputs]
    spec = {"format": torch_program.FORMAT, "version": torch_program.VERSION, "dtype": dtype,
            "inputs": [v.name for v in model.graph.inputs], "outputs": outputs,
            "weights_file": torch_program.WEIGHTS_FILE, "nodes": low.nodes}
    parallel = None
    if tp > 1:
        parallel = _write_ranks(low, spec, out_dir, tp, dtype, say, ep)
        nodes = parallel.pop("_nodes")
    else:
        (out_dir / torch_program.PROGRAM_FILE).write_text(json.dumps(spec, indent=0))
        say(f"      writing {len(low.weights)} weights ({dtype})")
        write_safetensors(out_dir / torch_program.WEIGHTS_FILE, list(low.weights.values()))
        nodes = low.nodes
    configs = attention_configs(nodes)
    kv_dtype = "float8_e4m3fn" if low.kv_fp8 else dtype
    if low.kv_fp8:
        low.fusions["fp8-kv-cache"] = len(low.kv_fp8)
    if not aot or os.environ.get("LLMC_CUDA_NO_AOT") == "1":  # an engine whose ops all run in plain torch
        say("      no ahead-of-time kernels (attention in plain torch, no CUDA graphs)")
        kernels = []
    else:
        say(f"      compiling {3 * len(configs)} attention and {len(low.kernel_requests)} fused kernels for sm_{sm} "
            "ahead of time")
        requests = low.kernel_requests
        if parallel:  # the fused kernels of a rank's blocks were asked for the full width: those run in torch
            named = {n["attrs"]["kernel"] for n in nodes if "kernel" in n["attrs"]}
            requests = {k: r for k, r in requests.items() if _node_key(k) in named}
        kernels = compile_kernels(configs, sm, dtype, kv_dtype, block_size, out_dir, fused=requests)
    program, weights = ((f"rank0/{torch_program.PROGRAM_FILE}", f"rank0/{torch_program.WEIGHTS_FILE}") if parallel
                        else (torch_program.PROGRAM_FILE, torch_program.WEIGHTS_FILE))
    return CudaEngineFiles(program=program, weights=weights, kernels=kernels, fusions=low.fusions, dtype=dtype,
                           kv_cache_dtype=kv_dtype, parallel=parallel)


def _write_ranks(low: _Lowering, spec: dict, out_dir: Path, tp: int, dtype: str, say, ep: bool = False) -> dict:
    """Shard the lowered program into ``tp`` rank programs and write each with its own weights file (each file
    streamed tensor by tensor, each tensor cut to the rank's share as it is written)."""
    from llmc.compiler import sharding

    plan = sharding.shard(low.nodes, low.weights, tp, experts="whole" if ep else "split")
    ranks = []
    for rank in plan.ranks:
        d = out_dir / f"rank{rank.rank}"
        d.mkdir()
        (d / torch_program.PROGRAM_FILE).write_text(json.dumps({**spec, "nodes": rank.nodes}, indent=0))
        say(f"      rank {rank.rank}: writing {len(rank.weights)} weights ({dtype})")
        write_safetensors(d / torch_program.WEIGHTS_FILE, list(rank.weights.values()))
        ranks.append({"rank": rank.rank, "program_file": f"rank{rank.rank}/{torch_program.PROGRAM_FILE}",
                      "weights_file": f"rank{rank.rank}/{torch_program.WEIGHTS_FILE}",
                      "weight_bytes": (d / torch_program.WEIGHTS_FILE).stat().st_size,
                      "sharded_bytes": rank.sharded_bytes})
    low.fusions["tensor-parallel-all-reduce"] = plan.all_reduces
    return {"tensor": tp, **({"expert": tp} if ep else {}), "heads_per_rank": plan.heads_per_rank,
            "kv_heads_per_rank": plan.kv_heads_per_rank,
            "kv_head_replicas": plan.kv_replicated, "collective": "nccl (gloo with device='cpu')",
            **plan.layout, "ranks": ranks, "_nodes": plan.ranks[0].nodes}


# -- further graphs (an encoder beside the language model) -------------------------------------------------------

ENCODER_ATTENTION_OP = "EncoderAttention"


def _sole_user(v: ir.Value) -> ir.Node | None:
    uses = list(v.uses())
    if len(uses) != 1 or v.is_graph_output():
        return None
    return _user(uses[0])


def _scale_of(v: ir.Value | None) -> float | None:
    t = _const(v)
    if t is None or v.producer() is not None:
        return None
    a = t.numpy().reshape(-1)
    return float(a[0]) if a.size == 1 else None


def encoder_attention_sites(graph: ir.Graph) -> dict[int, tuple[list[ir.Value], float, list[ir.Node]]]:
    """Unmasked attention written out as ops (``MatMul(q, kᵀ)`` [``* scale``] ``Softmax`` [``Cast``] [``Identity``]
    ``MatMul(·, v)``, what an encoder traced with eager attention holds): id of the last MatMul ->
    ``([q, kᵀ, v], scale, the nodes it replaces)``. Each intermediate value has that one user, so nothing else
    reads the ``[B, H, S, S]`` scores the fused op never makes."""
    sites = {}
    for soft in graph:
        if soft.op_type != "Softmax" or soft.domain != "" or soft.attributes.get("axis", None) is not None \
                and soft.attributes["axis"].value not in (-1, 3):
            continue
        nodes, scale = [soft], 1.0
        up = soft.inputs[0].producer() if soft.inputs[0] is not None else None
        if up is not None and up.op_type in ("Mul", "Div") and _sole_user(up.outputs[0]) is soft:
            s = _scale_of(up.inputs[1])
            if s is None or s == 0.0:
                continue
            scale = s if up.op_type == "Mul" else 1.0 / s
            nodes.insert(0, up)
            up = up.inputs[0].producer() if up.inputs[0] is not None else None
        if up is None or up.op_type != "MatMul" or _sole_user(up.outputs[0]) is not nodes[0]:
            continue
        q, kt = up.inputs
        if q is None or kt is None or q.shape is None or len(q.shape) != 4 or kt.shape is None or len(kt.shape) != 4:
            continue
        nodes.insert(0, up)
        tail = soft
        while True:
            nxt = _sole_user(tail.outputs[0])
            if nxt is None or nxt.op_type not in ("Cast", "Identity"):
                break
            if nxt.op_type == "Cast" and ir.DataType(nxt.attributes["to"].value) != q.dtype:
                break
            nodes.append(nxt)
            tail = nxt
        last = _sole_user(tail.outputs[0])
        if last is None or last.op_type != "MatMul" or last.inputs[0] is not tail.outputs[0]:
            continue
        sites[id(last)] = ([q, kt, last.inputs[1]], scale, nodes)
    return sites


class _GraphLowering(_Lowering):
    """A further graph's lowering: activations start at its float inputs, and unmasked attention becomes one
    :data:`ENCODER_ATTENTION_OP` node (torch's fused attention on a GPU: no ``[B, H, S, S]`` scores in memory)."""

    def __init__(self, model: ir.Model, dtype: str) -> None:
        roots = frozenset(v.name for v in model.graph.inputs if _IR_TO_NAME.get(v.dtype) in _FLOATS)
        super().__init__(model, dtype, roots)
        self.attention_sites = encoder_attention_sites(self.graph)
        self.fusions = {"encoder-attention": 0}

    def lower(self) -> None:
        dead = {id(n) for _, _, nodes in self.attention_sites.values() for n in nodes}
        for node in self.graph:
            if id(node) in dead:
                continue
            site = self.attention_sites.get(id(node))
            if site is not None:
                (q, kt, v), scale, _ = site
                self.emit(ENCODER_ATTENTION_OP, [self.input_name(node, 0, q), self.input_name(node, 1, kt),
                                                 self.input_name(node, 1, v)], [node.outputs[0].name],
                          {"scale": scale, "key_transposed": 1})
                self.fusions["encoder-attention"] += 1
            else:
                self._generic(node)

    def _fused_kernel(self, node: ir.Node, inputs: list[str], attrs: dict) -> str | None:
        """The encoder's own AOT kernels: LayerNorm and GELU (llmc.plugins.fused.encoder_kernels)."""
        from llmc.plugins.fused import requests as fk

        if node.op_type not in ("LayerNormalization", "Gelu"):
            return super()._fused_kernel(node, inputs, attrs)
        last = node.inputs[0].shape[-1] if node.inputs[0] is not None and node.inputs[0].shape else None
        if not isinstance(last, int) or id(node.inputs[0]) not in self.act:
            return None
        if node.op_type == "LayerNormalization":
            if attrs.get("axis", -1) not in (-1, len(node.inputs[0].shape) - 1):
                return None
            w = self.weights.get(inputs[1])
            b = self.weights.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
            if w is None or (len(inputs) > 2 and inputs[2] and b is None):
                return None
            req = fk.layer_norm_request(last, float(attrs.get("epsilon", 1e-5)), b is not None, _TL[self.dtype],
                                        _ST_TO_TL[w.dtype])
        else:
            req = fk.gelu_request(last, attrs.get("approximate", "none"), _TL[self.dtype])
        self.kernel_requests[req["key"]] = req
        return req["key"]


def prepare_graph(model: ir.Model) -> None:
    """The exact rewrites a further graph gets before its lowering (the ONNX Runtime backend leaves them to ORT's
    optimizer at load): constants folded, weights stored transposed, common subexpressions merged, and every
    remaining constant an initializer the program reads."""
    import onnx_ir.passes.common as common

    from llmc.passes import cleanup, weight_layout

    cleanup.fold_constants(model)
    weight_layout.transpose_weights(model)
    cleanup.common_subexpressions(model)
    cleanup.dead_code_elimination(model)
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)


def emit_graph(name: str, model: ir.Model, out_dir: Path, *, sm: int, dtype: str = "bfloat16", aot: bool = True,
               say: Callable[[str], None] | None = None) -> dict:
    """Write a further graph of the artifact (an encoder) as a program of its own in ``{name}/`` (``program.json``,
    ``weights.safetensors``, ``kernels/``: its AOT kernels); returns its manifest entry (paths from the artifact's
    root). Its precision is the engine's ``dtype``; it has no KV cache."""
    say = say or (lambda msg: None)
    prepare_graph(model)
    low = _GraphLowering(model, dtype)
    low.lower()
    dest = out_dir / name
    dest.mkdir(exist_ok=True)
    spec = {"format": torch_program.FORMAT, "version": torch_program.VERSION, "dtype": dtype,
            "inputs": [v.name for v in model.graph.inputs], "outputs": [v.name for v in model.graph.outputs],
            "weights_file": torch_program.WEIGHTS_FILE, "nodes": low.nodes}
    (dest / torch_program.PROGRAM_FILE).write_text(json.dumps(spec, indent=0))
    say(f"      graph {name}: {len(low.nodes)} nodes, {len(low.weights)} weights ({dtype})")
    write_safetensors(dest / torch_program.WEIGHTS_FILE, list(low.weights.values()))
    kernels = []
    if aot and os.environ.get("LLMC_CUDA_NO_AOT") != "1" and low.kernel_requests:
        say(f"      graph {name}: compiling {len(low.kernel_requests)} kernels for sm_{sm} ahead of time")
        kernels = [{**k, "file": f"{name}/{k['file']}"} for k in compile_fused(low.kernel_requests, sm, dest)]
    return {"backend": "cuda", "dtype": dtype, "program_file": f"{name}/{torch_program.PROGRAM_FILE}",
            "weights_file": f"{name}/{torch_program.WEIGHTS_FILE}", "kernels": kernels, "fusions": low.fusions,
            "inputs": spec["inputs"], "outputs": spec["outputs"]}
