"""What one decode step of a CUDA engine launches on the GPU, counted with no GPU.

The engine's session runs on torch's meta device (shapes and dtypes, no data, no memory): its weights come from the
weights file's header, its AOT kernels only record their launches (:class:`.kernels.RecordedKernel`), and the
program runs the step a GPU captures into a CUDA graph (the padded decode feeds of ``CudaSession._capture``) under a
torch dispatch mode that records every aten op that would launch a device kernel. Views, allocations and ops on
host metadata (shapes) launch nothing. Two things would break a CUDA graph's capture and are recorded as well: a
host synchronisation (a device value read on the host: ``.item()``, ``.tolist()``, ``.cpu()``, an op whose output
shape depends on device data) and a copy between host and device inside the step.

Nodes are assigned to decoder layers by the weights they read (``model.layers.N.``; other weights: outside the
layers) and, for nodes that read none, by the layer of the nodes that produce their inputs (a Split or a rotary
belongs to the projection it follows).
"""

from __future__ import annotations

import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmc.runtime.workers.cuda.program import ATTENTION_OP

# aten ops that launch no device kernel: views, metadata, allocations
_NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "slice", "select",
    "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "narrow",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "view_as_real",
    "view_as_complex", "_view", "set_", "resize_"})
# aten ops that read device values on the host (or whose output shape depends on them)
_SYNCS = frozenset({"item", "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
                    "unique_consecutive", "equal", "is_nonzero", "repeat_interleave_tensor"})
_LAYER_WEIGHT = re.compile(r"layers\.(\d+)\.")


class HostSync(RuntimeError):
    """A decode step read a device value on the host."""


@dataclass
class Launch:
    node: int  # program node index
    op: str  # the node's program op
    kernel: str  # the aten op, or the AOT kernel's entry name


@dataclass
class DecodeStructure:
    """One decode step of ``batch`` sequences, as a GPU would run it (counted on the meta device)."""

    batch: int
    layers: int
    per_layer: list[int]  # kernel launches of each decoder layer
    outside: int  # launches outside the layers (embedding, rotary angles, final norm, lm_head)
    launches: list[Launch]
    node_layers: list[int | None]
    host_syncs: list[str] = field(default_factory=list)
    host_copies: list[str] = field(default_factory=list)
    device_weight_bytes: int = 0  # bytes of the tensors the program holds on the device
    weights_file_bytes: int = 0  # bytes of the tensors in the weights file
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    largest_writes: dict[int, int] = field(default_factory=dict)  # node -> elements of the largest tensor it writes
    aot_kernels: bool = False  # the engine has its AOT kernels (a GPU session captures decode in CUDA graphs)
    tokens: int = 1  # new tokens per sequence: 1 a decode step, more a prefill step

    @property
    def rows(self) -> int:
        """The activation rows of the step (tokens of all its sequences)."""
        return self.batch * self.tokens

    @property
    def capture_safe(self) -> bool:
        """Nothing in the step stops a CUDA graph from capturing it (and the session captures it)."""
        return self.aot_kernels and not self.host_syncs and not self.host_copies

    def kernels_by_op(self, layer: int) -> dict[str, int]:
        """Launches of ``layer`` per program op, in program order."""
        return dict(Counter(x.op for x in self.launches if self.node_layers[x.node] == layer))

    def summary(self) -> list[str]:
        """Lines for ``llmc inspect``."""
        steady = self.per_layer[-1] if self.per_layer else 0
        by_op = ", ".join(f"{op} {n}" for op, n in self.kernels_by_op(self.layers - 1).items())
        lines = [f"kernels     decode step (batch {self.batch}): {sum(self.per_layer) + self.outside} launches = "
                 f"{self.layers} layers × {steady} (per layer: {', '.join(map(str, self.per_layer))}) "
                 f"+ {self.outside} outside the layers",
                 f"  per layer {by_op} (layer {self.layers - 1})",
                 f"  weights   {self.device_weight_bytes:,} bytes on the device ("
                 + ", ".join(f"{d} {b:,}" for d, b in sorted(self.weight_bytes_by_dtype.items()))
                 + f"); weights file {self.weights_file_bytes:,}",
                 "  graphs    " + ("decode captured in CUDA graphs (no host sync, no host copy in a step)"
                                  if self.capture_safe else self._why_not_captured())]
        return lines

    def _why_not_captured(self) -> str:
        if not self.aot_kernels:
            return "eager (no AOT kernels in this engine)"
        return "not capture-safe: " + "; ".join(self.host_syncs + self.host_copies)


class _Recorder(TorchDispatchMode):
    """Records the aten ops of a meta-device run that would launch device kernels, per program node."""

    def __init__(self) -> None:
        super().__init__()
        self.node = -1
        self.kernels: list[tuple[int, str]] = []
        self.syncs: list[str] = []
        self.copies: list[str] = []
        self.largest: dict[int, int] = {}

    def at_node(self, i: int) -> None:
        self.node = i

    def append(self, launch: tuple[str, tuple]) -> None:
        """An AOT kernel's launch (:class:`.kernels.RecordedKernel`)."""
        self.kernels.append((self.node, launch[0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if name in _SYNCS and "meta" in devices:
            self.syncs.append(f"node {self.node}: aten.{name}")
            raise HostSync(f"node {self.node} reads a device value on the host (aten.{name})")
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:  # a meta tensor's data was asked for: the host needs it
            if "meta" not in str(e):
                raise
            self.syncs.append(f"node {self.node}: aten.{name} ({e})")
            raise HostSync(f"node {self.node} needs device data on the host (aten.{name})") from e
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_devices = {t.device.type for t in outs}
        if len(devices | out_devices) > 1 and (name in ("_to_copy", "copy_", "to") or "cpu" in out_devices):
            self.copies.append(f"node {self.node}: aten.{name} between host and device")
        elif "meta" in devices | out_devices and name not in _NO_KERNEL:
            self.kernels.append((self.node, f"aten.{name}"))
            self.largest[self.node] = max([self.largest.get(self.node, 0),
                                           *(t.numel() for t in outs if t.device.type == "meta")])
        return out


def node_layers(spec: dict) -> list[int | None]:
    """The decoder layer of each program node (None: outside the layers); see the module docstring."""
    producer_layer: dict[str, int | None] = {}
    out: list[int | None] = []
    for node in spec["nodes"]:
        named = [m for name in node["inputs"] if name and (m := _LAYER_WEIGHT.search(name))]
        if node["op"] == ATTENTION_OP:
            layer = int(node["attrs"]["layer_idx"])
        elif named:
            layer = int(named[0].group(1))
        elif any(name and "." in name and name not in producer_layer for name in node["inputs"]):
            layer = None  # reads a model weight outside the layers (embedding, final norm, lm_head)
        else:
            known = [producer_layer[n] for n in node["inputs"] if producer_layer.get(n) is not None]
            layer = max(known) if known else None
        out.append(layer)
        for name in node["outputs"]:
            producer_layer[name] = layer
    return out


def weights_file_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file (the file less its header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def decode_structure(root: Path, manifest: dict, batch: int = 1, tokens: int = 1) -> DecodeStructure:
    """Count what one decode step of ``batch`` sequences launches on the GPU (see the module docstring);
    ``tokens`` > 1: a prefill step instead, each sequence's first ``tokens`` tokens (run eagerly on a GPU, never
    captured: counted for what it launches and writes, e.g. that no linear dequantizes its weight)."""
    from llmc.runtime.workers.cuda.session import CudaSession

    root = Path(root)
    session = CudaSession(root, manifest, device="meta", cuda_graphs=False)
    session.allocate_pool(manifest["kv_cache"], num_blocks=max(1, batch) * session._max_blocks)
    if manifest.get("state_cache"):
        session.allocate_state(manifest["state_cache"], batch + 1)
    feeds = session._static_feeds(batch) if tokens == 1 else _prefill_feeds(session, batch, tokens)
    rec = _Recorder()
    for kernel in session.kernels.values():
        kernel.log = rec  # launches recorded in order with the aten ops around them
    try:
        with torch.inference_mode(), rec:
            session.program.run(feeds, on_node=rec.at_node)
    except HostSync:
        pass
    return _structure(root, session, rec, batch, tokens)


def _prefill_feeds(session, batch: int, tokens: int) -> dict[str, torch.Tensor]:
    """A prefill step's feeds on the session's device: ``batch`` sequences of ``tokens`` new tokens each, nothing
    cached before them (slots -1: the counted step writes no cache)."""
    z = dict(dtype=torch.int64, device=session.device)
    feeds = session._static_feeds(batch)
    t = batch * tokens
    feeds.update(input_ids=torch.zeros(t, **z), positions=torch.zeros(t, **z), slot_mapping=torch.full((t,), -1, **z),
                 context_lens=torch.full((batch,), tokens, **z), query_start_loc=torch.arange(batch + 1, **z) * tokens,
                 logits_indices=torch.arange(1, batch + 1, **z) * tokens - 1)
    if "lora_slots" in feeds:
        feeds["lora_slots"] = torch.zeros(t, **z)
    return feeds


def _structure(root: Path, session, rec: _Recorder, batch: int, tokens: int = 1) -> DecodeStructure:
    spec = session.program.spec
    layers_of = node_layers(spec)
    launches = [Launch(i, spec["nodes"][i]["op"], k) for i, k in rec.kernels if i >= 0]
    num_layers = sum(1 for n in spec["nodes"] if n["op"] == ATTENTION_OP)
    per = Counter(layers_of[x.node] for x in launches)
    held = session.program.constants()
    by_dtype: Counter = Counter()
    for t in held:
        by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return DecodeStructure(
        batch=batch, tokens=tokens, layers=num_layers, per_layer=[per.get(i, 0) for i in range(num_layers)],
        outside=per.get(None, 0),
        launches=launches, node_layers=layers_of, host_syncs=rec.syncs, host_copies=rec.copies,
        device_weight_bytes=sum(by_dtype.values()), weights_file_bytes=weights_file_bytes(root / spec["weights_file"]),
        weight_bytes_by_dtype=dict(by_dtype), largest_writes=rec.largest,
        aot_kernels=any(v != "fused" for _, v in session.kernels))
