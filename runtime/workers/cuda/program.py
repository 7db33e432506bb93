"""A CUDA engine's program: the compiler's fused graph as a flat node list, executed with torch.

On disk (written by ``llmc.compiler.backends.cuda``): ``program.json`` and ``weights.safetensors``.

``program.json``::

    {"format": "llmc-torch-program", "version": 1, "dtype": "bfloat16",
     "inputs": ["input_ids", ...], "outputs": ["logits"], "weights_file": "weights.safetensors",
     "nodes": [{"op": "MatMul", "inputs": ["x", "w"], "outputs": ["y"], "attrs": {}}, ...]}

Node inputs name graph inputs, weights (tensors of the safetensors file) or earlier outputs; an
empty name is an omitted optional input. ``op`` is a key of :data:`llmc.runtime.workers.cuda.ops.OPS` or
``PagedAttention``, which the caller binds to the KV pool (see :class:`Program`).

The executor resolves names to slots once, turns small integer constants that ops read as
shapes or axes into Python lists, and frees every intermediate after its last use. It runs the
same on CUDA tensors and on CPU tensors; a CUDA session captures it in CUDA graphs for decode.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmc.plugins.recurrent import CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE
from llmc.runtime.workers.cuda.ops import DTYPES, OPS

FORMAT = "llmc-torch-program"
VERSION = 1
PROGRAM_FILE = "program.json"
WEIGHTS_FILE = "weights.safetensors"
ATTENTION_OP = "PagedAttention"
# Ops of recurrent layers (hybrid models): they read and write the session's state pool, so the session binds them
# (``overrides``), as it binds attention to its KV pool.
STATE_OPS = frozenset({CONV_OP_TYPE, DELTA_OP_TYPE, SSD_OP_TYPE})
# Inputs that ops read as Python integers (shapes, axes, sizes): constants become lists at load.
HOST_INPUTS = {"Reshape": (1,), "Split": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Slice": (1, 2, 3, 4),
               "TopK": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
               "ReduceMin": (1,), "Expand": (1,), "Tile": (1,), "Pad": (1, 3),
               "ConstantOfShape": (0,)}
HOST_INPUTS["Range"] = (0, 1, 2)  # its output is host metadata too (torch_ops.range_)
# ... and as Python floats (a scalar exponent: no host sync inside a captured CUDA graph).
HOST_SCALARS = {"Pow": (1,)}

# attention(attrs, query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, sinks=None,
#           attend_end=None) -> out
# (sinks: the node's optional input 7, attention-sink logits [num_heads]; attend_end: its optional input 8, the
# bidirectional spans [T] int64; each passed only where the node has it)
Attention = Callable[..., torch.Tensor]


def supported_ops() -> frozenset[str]:
    """Every op a program may use."""
    return frozenset(OPS) | {ATTENTION_OP} | STATE_OPS


def read_spec(root: Path) -> dict:
    spec = json.loads((root / PROGRAM_FILE).read_text())
    if spec.get("format") != FORMAT or spec.get("version") != VERSION:
        raise ValueError(f"{root / PROGRAM_FILE}: not an {FORMAT} version {VERSION} file")
    return spec


def load_weights(root: Path, spec: dict, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the program's weights file, on ``device``."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(root / spec["weights_file"]), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            out[name] = f.get_tensor(name).to(device, non_blocking=False)
    return out


def meta_weights(root: Path, spec: dict, host_numel: int = 64) -> dict[str, torch.Tensor]:
    """The program's weights on the meta device (shapes and dtypes from the file's header, no data read), except
    tensors of at most ``host_numel`` elements, read on the CPU: the constants a program reads as shapes and axes."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(root / spec["weights_file"]), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            sl = f.get_slice(name)
            shape = [int(d) for d in sl.get_shape()]
            if math.prod(shape) <= host_numel:
                out[name] = f.get_tensor(name)
            else:
                out[name] = torch.empty(shape, dtype=_SAFETENSORS_DTYPES[sl.get_dtype()], device="meta")
    return out


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
                       "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                       "F8_E4M3": torch.float8_e4m3fn}


@dataclass
class _Step:
    fn: Callable
    args: list  # ("slot", i) | ("const", value) | ("none", None)
    outs: list[int]
    attrs: dict
    free: list[int]


class Program:
    """An executable program. ``attention`` runs the ``PagedAttention`` nodes (it owns the KV pool);
    ``overrides`` replace the torch implementation of ops by name (the CUDA session's fused kernels).

    :meth:`run` takes the step's graph inputs as tensors on the program's device and returns the
    outputs named in the spec, in order.
    """

    def __init__(self, spec: dict, weights: dict[str, torch.Tensor], attention: Attention,
                 overrides: dict[str, Callable] | None = None) -> None:
        self.spec = spec
        self.dtype = DTYPES[spec["dtype"]]
        self.input_names: tuple[str, ...] = tuple(spec["inputs"])
        slots: dict[str, int] = {}
        for name in self.input_names:
            slots[name] = len(slots)
        last_use: dict[int, int] = {}
        steps: list[_Step] = []
        for i, node in enumerate(spec["nodes"]):
            opname = node["op"]
            if opname == ATTENTION_OP:
                fn = _bind_attention(attention)
            else:
                fn = (overrides or {}).get(opname, OPS.get(opname))
            if fn is None:
                raise ValueError(f"program op {opname!r} " + ("needs a state pool, which this session does not bind"
                                                             if opname in STATE_OPS else "is unknown to this runtime"))
            args = []
            for j, name in enumerate(node["inputs"]):
                if not name:
                    args.append(("none", None))
                elif name in slots:
                    args.append(("slot", slots[name]))
                    last_use[slots[name]] = i
                elif name in weights:
                    w = weights[name]
                    if j in HOST_INPUTS.get(opname, ()) and not w.is_floating_point() and w.numel() <= 64:
                        args.append(("const", [int(v) for v in w.reshape(-1).tolist()]))
                    elif j in HOST_SCALARS.get(opname, ()) and w.numel() == 1:
                        args.append(("const", float(w.reshape(-1)[0])))
                    else:
                        args.append(("const", w))
                else:
                    raise ValueError(f"program node {i} ({opname}) reads {name!r}, which nothing defines")
            outs = []
            for name in node["outputs"]:
                slots[name] = len(slots)
                outs.append(slots[name])
            steps.append(_Step(fn, args, outs, dict(node.get("attrs", {})), []))
        self.output_slots = [slots[n] for n in spec["outputs"]]
        keep = set(self.output_slots)
        for slot, i in last_use.items():
            if slot not in keep and slot >= len(self.input_names):
                steps[i].free.append(slot)
        self._steps = steps
        self._num_slots = len(slots)

    def constants_to(self, device: str | torch.device) -> None:
        """Move every tensor constant the nodes read to ``device`` (the meta device: what a step would launch,
        counted with no memory; :mod:`llmc.runtime.workers.cuda.launches`)."""
        for st in self._steps:
            st.args = [(kind, v.to(device)) if kind == "const" and isinstance(v, torch.Tensor) else (kind, v)
                       for kind, v in st.args]

    def prepare(self, op: str, fn: Callable[[list], list]) -> None:
        """Rewrite the arguments of every ``op`` node once, at load: ``fn`` takes and returns the node's argument list
        (``("slot", i)``, ``("const", value)`` or ``("none", None)`` each), e.g. to fold constant scales together."""
        for st, node in zip(self._steps, self.spec["nodes"], strict=True):
            if node["op"] == op:
                st.args = fn(list(st.args))

    def constants(self) -> list[torch.Tensor]:
        """The distinct tensor constants the nodes read (what the program holds in device memory)."""
        seen: dict[int, torch.Tensor] = {}
        for st in self._steps:
            for kind, v in st.args:
                if kind == "const" and isinstance(v, torch.Tensor):
                    seen.setdefault(id(v), v)
        return list(seen.values())

    def run(self, feeds: dict[str, torch.Tensor], on_node: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """``on_node(i)``: called before node ``i`` runs (launch counting)."""
        env: list = [None] * self._num_slots
        for i, name in enumerate(self.input_names):
            env[i] = feeds[name]
        for i, st in enumerate(self._steps):
            if on_node is not None:
                on_node(i)
            args = [env[v] if kind == "slot" else v for kind, v in st.args]
            results = st.fn(*args, **st.attrs)
            for slot, value in zip(st.outs, results, strict=False):
                env[slot] = value
            for slot in st.free:
                env[slot] = None
        return [env[s] for s in self.output_slots]


def _bind_attention(attention: Attention) -> Callable:
    def run(query, key, value, slot_mapping, block_tables, context_lens, query_start_loc, sinks=None, attend_end=None,
            **attrs):
        # Optional inputs by keyword only where present: attention callables that predate one need not take it.
        opt = {k: v for k, v in (("sinks", sinks), ("attend_end", attend_end)) if v is not None}
        return (attention(attrs, query, key, value, slot_mapping, block_tables, context_lens, query_start_loc,
                          **opt),)
    return run
