"""Run an engine graph over token windows one decoder layer at a time, so that scoring a model needs the memory of
one layer's weights, not of the model.

The accuracy report scores the quantized engine and the unquantized reference on held-out windows. Loading either
as one ONNX Runtime session holds the whole model (an 8B reference in float32: 32 GB). Here the graph ONNX Runtime
would run (lowered for the CPU backend, fusions applied: the same nodes, the same kernels) is cut into stages:

- a node's stage is the largest decoder-layer index among its weights' names (``model.layers.7.mlp...`` -> 7) and
  its inputs' stages; nodes with neither (the embedding gather, position arithmetic) form stage -1, and the final
  norm and LM head join the last layer's stage;
- each stage becomes its own model: its nodes, its weights, and as inputs the values it reads from earlier stages
  (the residual stream, positions) or from the graph's inputs.

Every window goes through stage 0 before any goes through stage 1. Between stages only the carried values are
kept (windows x tokens x hidden, in float32); a stage's weights are read (from the checkpoint, lazily derived, or
memory-mapped from the artifact) when its session is made and dropped with it. ONNX Runtime gets them as external
initializers (``SessionOptions.add_external_initializers``), except dtypes numpy cannot hold natively (bfloat16,
FP8, INT4), which travel in the model bytes. Where ONNX Runtime copies them into the session (1.32 does:
:mod:`llmc.quant.ort_copies`), the arrays are dropped once it is made.

The session options are the engine's own (:class:`llmc.runtime.session.OrtSession`), so each stage computes what
the whole engine computes: the figures equal whole-model scoring's (tested to 1e-5 relative).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from llmc.quant.layer_names import layer_of

PRE = -1  # the stage of nodes before the first layer (embeddings, position arithmetic)
# numpy dtypes ONNX Runtime takes as external initializers (OrtValue.ortvalue_from_numpy).
# bfloat16 and FP8 weights: external initializers too, handed to ORT by their bits (OrtSession); in the model bytes
# they were copied three times (proto, serialized model, ORT's parse): ~14 s of a 1B reference's sessions.
_BY_BITS = {ir.DataType.BFLOAT16, ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E5M2}
_NATIVE = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.INT8, ir.DataType.UINT8,
           ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.INT32, ir.DataType.UINT32, ir.DataType.INT64,
           ir.DataType.UINT64, ir.DataType.BOOL}


# Initializers smaller than this travel in the model bytes: shape inference must read constant shape arguments.
EMBED_BELOW = 1 << 16


@dataclass
class Stage:
    """One slice of the graph: ``nodes`` in graph order, the ``weights`` they read, the ``inputs`` they read from
    earlier stages or the graph's inputs, and the ``outputs`` later stages (or the graph's outputs) read."""

    index: int
    nodes: list[ir.Node] = field(default_factory=list)
    weights: list[ir.Value] = field(default_factory=list)
    inputs: list[ir.Value] = field(default_factory=list)
    outputs: list[ir.Value] = field(default_factory=list)

    def weight_bytes(self) -> int:
        return sum(_nbytes(v.const_value) for v in self.weights)


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n * t.dtype.itemsize if t.dtype.itemsize >= 1 else -(-n * t.dtype.bitwidth // 8)


class NotLayered(Exception):
    """The graph cannot be cut into layers (subgraphs capture outer values); score it whole."""


def partition(model: ir.Model) -> list[Stage]:
    """Cut ``model``'s graph into stages (see the module docstring). Raises :class:`NotLayered` for graphs with
    control-flow subgraphs, whose captured outer values are not node inputs."""
    graph = model.graph
    initializers = graph.initializers
    stage_of: dict[int, int] = {}  # id(node) -> stage
    order: list[tuple[ir.Node, int]] = []
    for node in graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()
               if isinstance(a, ir.Attr)):
            raise NotLayered(f"{node.op_type} node {node.name!r} has a subgraph")
        s = PRE
        for v in node.inputs:
            if v is None:
                continue
            producer = v.producer()
            if producer is not None:
                s = max(s, stage_of[id(producer)])
            elif v.name in initializers:
                layer = layer_of(v.name)
                if layer is not None:
                    s = max(s, layer)
        stage_of[id(node)] = s
        order.append((node, s))
    # Nodes that read only weights (a dequantized LM head named without a layer index) run where they are used:
    # left in stage -1 their outputs would be carried, weight-sized, beside every window.
    constant: set[int] = set()
    for node, _ in order:
        if all(v is None or (v.producer() is None and v.name in initializers)
               or (v.producer() is not None and id(v.producer()) in constant) for v in node.inputs):
            constant.add(id(node))
    for node, _ in reversed(order):
        if id(node) in constant:
            users = [stage_of[id(u.node)] for out in node.outputs for u in out.uses()]
            if users and min(users) > stage_of[id(node)]:
                stage_of[id(node)] = min(users)
    order = [(node, stage_of[id(node)]) for node, _ in order]
    by_index: dict[int, Stage] = {}
    for node, s in order:
        by_index.setdefault(s, Stage(s)).nodes.append(node)
    stages = [by_index[k] for k in sorted(by_index)]
    graph_outputs = {id(v) for v in graph.outputs}
    for stage in stages:
        own = {id(n) for n in stage.nodes}
        seen: set[int] = set()
        for node in stage.nodes:
            for v in node.inputs:
                if v is None or id(v) in seen:
                    continue
                seen.add(id(v))
                producer = v.producer()
                if producer is not None and id(producer) in own:
                    continue
                if producer is None and v.name in initializers:
                    stage.weights.append(v)
                else:
                    stage.inputs.append(v)
            for v in node.outputs:
                if id(v) in graph_outputs or any(id(use.node) not in own for use in v.uses()):
                    stage.outputs.append(v)
    return stages


def _tensor_proto(value: ir.Value, embed: bool):
    """An initializer's TensorProto: holding its bytes (``embed``; ONNX's packing, INT4 two to a byte), or naming it
    with no data (ONNX Runtime takes the data as an external initializer)."""
    import onnx

    t = value.const_value
    proto = onnx.TensorProto()
    proto.name = value.name
    proto.data_type = int(t.dtype)
    proto.dims.extend(int(d) for d in t.shape)
    if embed:
        proto.raw_data = t.tobytes()
    else:
        proto.data_location = onnx.TensorProto.EXTERNAL
        entry = proto.external_data.add()
        entry.key, entry.value = "location", "llmc-external-initializer"
    return proto


def _value_info(value: ir.Value, array: np.ndarray | None):
    """``value``'s ValueInfoProto; where the graph does not know its type, the type of the array it holds."""
    import onnx
    from onnx import helper

    if value.type is not None or array is None:
        return ir.serde.serialize_value(value)
    dims = [f"{value.name}_d{i}" for i in range(array.ndim)]
    return helper.make_tensor_value_info(value.name, helper.np_dtype_to_tensor_dtype(array.dtype), dims) \
        if array.dtype != np.dtype(object) else onnx.ValueInfoProto(name=value.name)


@dataclass
class StageWeights:
    """A stage's initializers made ready for its session: ``protos`` (each TensorProto, holding its bytes or naming
    an external initializer) and ``external`` (name -> array ONNX Runtime takes as that external initializer)."""

    protos: list = field(default_factory=list)
    external: dict[str, np.ndarray] = field(default_factory=dict)


def stage_weights(stage: Stage) -> StageWeights:
    """Read (or derive) every weight of ``stage``: the costly part of making its session, which needs none of the
    values carried from earlier stages, so :class:`LayerwiseScorer` does it for the next stage on a thread."""
    out = StageWeights()
    for v in stage.weights:
        t = v.const_value
        if (t.dtype in _NATIVE or t.dtype in _BY_BITS) and _nbytes(t) >= EMBED_BELOW:
            array = np.asarray(t.numpy())
            if not array.flags.c_contiguous or not array.flags.writeable:
                array = np.array(array, order="C")  # ORT reads it in place: an owned, contiguous copy
            out.external[v.name] = array
            out.protos.append(_tensor_proto(v, embed=False))
        else:  # small (shape arguments, which shape inference reads), or INT4 codes: in the model bytes (ir packs
            # them as ONNX stores them)
            out.protos.append(_tensor_proto(v, embed=True))
        if isinstance(t, ir.ExternalTensor):
            t.release()  # unmap: the artifact's pages would otherwise stay mapped (and counted) until the end
    return out


def stage_model(model: ir.Model, stage: Stage, carried: dict[str, np.ndarray],
                weights: StageWeights | None = None) -> tuple[bytes, dict[str, np.ndarray]]:
    """The stage as serialized ONNX bytes, and the external initializers its session takes (name -> array).

    ``carried``: an array of every input that comes from an earlier stage (for its dtype where the graph lacks
    one). ``weights``: :func:`stage_weights` of the stage, made already (else read now)."""
    from onnx import helper

    weights = weights if weights is not None else stage_weights(stage)
    graph = helper.make_graph(
        [ir.serde.serialize_node(n) for n in stage.nodes], f"stage_{stage.index}",
        [_value_info(v, carried.get(v.name)) for v in stage.inputs],
        [ir.serde.serialize_value(v) for v in stage.outputs], initializer=weights.protos)
    opsets = [helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    for f in model.functions.values():
        proto.functions.append(ir.serde.serialize_function(f))
    return proto.SerializeToString(), weights.external


@dataclass
class KVShape:
    """The scoring pool's per-layer cache: ``num_layers`` x ``[blocks, num_kv_heads, block_size, head_size]``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str = "float32"
    layers: list[dict] | None = None  # the manifest's kv_cache.layers (per-layer geometry), if any
    # A hybrid model's recurrent state: the manifest's ``state_cache`` section (llmc.runtime.core.state_cache), if any.
    state: dict | None = None


def batch_feeds(windows: list[list[int]], block_size: int, first_block: int = 0) -> dict[str, np.ndarray]:
    """The graph inputs of several windows scored together as one prefill step of as many sequences (the engine's
    continuous batching, as ``Engine.score`` feeds one window): window ``i`` is sequence ``i``, alone on its own
    blocks (from ``first_block``, after window ``i - 1``'s), every token's logits row wanted (``rope_lengths``:
    every token's sequence length, for graphs that take it)."""
    lens = np.asarray([len(w) for w in windows], np.int64)
    blocks = -(-lens // block_size)
    first = first_block + np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    p = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
    start = np.repeat(first, lens)
    table = np.zeros((len(windows), int(blocks.max())), np.int64)
    for i, (f, b) in enumerate(zip(first, blocks, strict=True)):
        table[i, :b] = np.arange(f, f + b)
    total = int(lens.sum())
    return {"input_ids": np.asarray([t for w in windows for t in w], np.int64), "positions": p,
            "slot_mapping": (start + p // block_size) * block_size + p % block_size,
            "block_tables": table, "context_lens": lens,
            "query_start_loc": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            "logits_indices": np.arange(total, dtype=np.int64),
            "rope_lengths": np.repeat(lens, lens), "lora_slots": np.zeros(total, np.int64)}


class LayerwiseScorer:
    """Logits of token windows from ``model`` (a graph lowered for the ONNX Runtime backend), one stage at a time.

    ``custom_ops``: the custom-op library its attention nodes need (``engine.custom_ops``); ``kv``: the engine's KV
    cache layout. ``progress`` gets a line per stage once a pass over the stages has run ``PROGRESS_S`` seconds,
    with the process's resident memory."""

    PROGRESS_S = 10.0
    # Windows run together up to these: 2048 tokens keep an 8B layer's working values (the MLP's [tokens, 14336]
    # float32 values) near 0.4 GB, and ran as fast as 4096 at 8B (reference 152 vs 167 s, FP8 side 235 vs 231 s;
    # one window a step: 215 and 607 s); a group's float32 logits, which ORT returns and the round then keeps, at
    # most 512 MB (a 128k vocabulary: 4 windows a group).
    BATCH_TOKENS = 2048
    BATCH_LOGITS_BYTES = 512 << 20
    BATCH_STATE_BYTES = 256 << 20  # a hybrid model's state slots (every layer's, written as its stage runs)

    def __init__(self, model: ir.Model, custom_ops: str, kv: KVShape, name: str = "model",
                 progress: Callable[[str], None] | None = None, batch_tokens: int | None = None) -> None:
        self.model = model
        self.stages = partition(model)
        self.custom_ops = custom_ops
        self.kv = kv
        self.name = name
        self.say = progress or (lambda msg: None)
        self.graph_inputs = {v.name for v in model.graph.inputs}
        # Inputs of a fixed shape that no window supplies (a LoRA engine's adapter slots, llmc.passes.lora): zeros,
        # which with lora_slots 0 score the base model.
        self.fixed = {v.name: np.zeros([int(d) for d in v.shape], v.dtype.numpy()) for v in model.graph.inputs
                      if v.shape is not None and v.shape.rank() > 0 and all(isinstance(d, int) for d in v.shape)}
        self.output = model.graph.outputs[0].name
        self.batch_tokens = batch_tokens or self.BATCH_TOKENS
        # Per layer, the layer whose cache it reads (KV-shared layers: an earlier one), and each cache's last reader.
        from llmc.runtime.core.kv_cache import layer_geometry

        self._owner = [o for o, _, _ in layer_geometry(kv.num_layers, kv.num_kv_heads, kv.head_size, kv.layers)]
        self._last_reader = {o: i for i, o in enumerate(self._owner)}
        self.session_seconds = 0.0
        self.run_seconds = 0.0

    def largest_stage_bytes(self) -> int:
        return max(s.weight_bytes() for s in self.stages)

    def _defaults(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        """Feeds of an image build's language model for text tokens at ``positions``: no image rows, and M-RoPE
        positions of text (every axis the token's position)."""
        out: dict[str, np.ndarray] = {}
        n = len(positions)
        if "image_rows" in self.graph_inputs:
            width = next(int(v.shape[1]) for v in self.model.graph.inputs if v.name == "image_embeds")
            out.update(image_rows=np.zeros(0, np.int64), image_embeds=np.zeros((0, width), np.float32))
        if "attend_end" in self.graph_inputs:  # causal everywhere
            out["attend_end"] = np.zeros(n, np.int64)
        if "mrope_positions" in self.graph_inputs:
            out["mrope_positions"] = np.broadcast_to(positions, (3, n)).copy()
        return out

    def batches(self, windows: list[list[int]]) -> list[list[int]]:
        """Window indices in the groups run as one step each: consecutive windows up to ``batch_tokens`` tokens,
        ``BATCH_LOGITS_BYTES`` of float32 logits and, for a hybrid model, ``BATCH_STATE_BYTES`` of recurrent state (a
        slot per window) (at least one window a group)."""
        from llmc.runtime.core.state_cache import StatePool

        vocab = self.model.graph.outputs[0].shape[-1] if self.model.graph.outputs[0].shape is not None else None
        limit = self.batch_tokens
        if isinstance(vocab, int) and vocab > 0:
            limit = min(limit, self.BATCH_LOGITS_BYTES // (4 * vocab))
        most = len(windows)
        if self.kv.state is not None:
            most = max(1, self.BATCH_STATE_BYTES // max(1, StatePool.bytes_per_slot(self.kv.state)))
        out: list[list[int]] = []
        tokens = 0
        for i, w in enumerate(windows):
            if out and tokens + len(w) <= limit and len(out[-1]) < most:
                out[-1].append(i)
                tokens += len(w)
            else:
                out.append([i])
                tokens = len(w)
        return out

    def _inputs(self, windows: list[list[int]], groups: list[list[int]],
                extras: list[dict[str, np.ndarray]] | None = None):
        """The scoring pool, each group's feeds (``extras[i]``: window ``i``'s further inputs, e.g. its image rows,
        for a group of that window alone) and the recurrent state (None without recurrent layers).

        Every group has blocks of its own, so a layer's cache holds every window's keys and values once its stage
        has run (a KV-shared layer of a later stage reads them); the pool is allocated zeroed, untouched (pages
        the kernel maps on first write), and a layer's arrays are dropped once its last reader has run."""
        from llmc.runtime.core.kv_cache import KVPool

        kv = self.kv
        group_feeds: list[dict[str, np.ndarray]] = []
        offset = 0
        for g in groups:
            f = {**self.fixed, **batch_feeds([windows[i] for i in g], kv.block_size, offset)}
            f.update(self._defaults(f["positions"]))
            if extras is not None:
                if len(g) != 1:
                    raise ValueError("windows with extra inputs are scored a window a group")
                f.update(extras[g[0]])
            offset += sum(-(-len(windows[i]) // kv.block_size) for i in g)
            group_feeds.append(f)
        pool = KVPool.allocate(kv.num_layers, offset, kv.num_kv_heads, kv.block_size, kv.head_size, kv.dtype,
                               kv.layers)
        # Recurrent layers (hybrid models): a state slot per window of a group. Each window is its sequence's whole
        # context in one step, so the ops start it from a zero state and carry the state through the window, as a
        # whole-sequence prefill does; the next group (in this stage or a later one) starts over in the same slots.
        state = None
        if kv.state is not None:
            from llmc.runtime.core.state_cache import StatePool

            state = StatePool.allocate(kv.state, max(len(g) for g in groups)).arrays
            for g, f in zip(groups, group_feeds, strict=True):
                f["state_slots"] = np.arange(len(g), dtype=np.int64)
        return pool, group_feeds, state

    def _release_layers(self, pool, done_stage: int, released: set[int]) -> None:
        """Replace the caches no stage after ``done_stage`` reads (owners not yet in ``released``) with fresh
        untouched zeros (a new list: the native kernels rebind on a new pool object), so that only the running
        layers' caches are resident."""
        layers = list(pool.layers)
        for i, owner in enumerate(self._owner):
            if owner in released or self._last_reader[owner] > done_stage:
                continue
            if i == owner:
                k = layers[owner][0]
                layers[i] = (np.zeros(k.shape, k.dtype), np.zeros(k.shape, k.dtype))
            else:  # a KV-shared layer: its owner's fresh pair (owners come first)
                layers[i] = layers[owner]
        done = {o for o in self._owner if self._last_reader[o] <= done_stage} - released
        if done:
            released |= done
            pool.layers = layers

    def run(self, windows: list[list[int]], prefetch: bool = False,
            extras: list[dict[str, np.ndarray]] | None = None) -> list[np.ndarray]:
        """float32 logits ``[len(w), vocab]`` of every window ``w`` (each its own sequence, as ``Engine.score``
        scores it; windows run together a group a step, :meth:`batches`: a stage's weights, an FP8 stage's
        dequantized ones included, are made once a group, not once a window).

        Where ONNX Runtime copies a session's external initializers (:mod:`llmc.quant.ort_copies`), the arrays are
        dropped once the session is made (one layer's weights less resident while it runs). With ``prefetch`` the
        next stage's weights are then read on a thread while this stage runs: off by default, as on two cores that
        thread competes with ONNX Runtime's (benchmarks/results/bench_quant_report_model-1b_int4.json: the
        reading moved into the run's time, no faster)."""
        from concurrent.futures import ThreadPoolExecutor

        from llmc.quant.ort_copies import ort_copies_initializers, release_freed_memory

        if not windows:
            return []
        groups = [[i] for i in range(len(windows))] if extras is not None else self.batches(windows)
        pool, feeds, state = self._inputs(windows, groups, extras)
        carried: list[dict[str, np.ndarray]] = [{} for _ in groups]
        # After which stage each carried value is read for the last time.
        last_use: dict[str, int] = {}
        for i, stage in enumerate(self.stages):
            for v in stage.inputs:
                last_use[v.name] = i
        start = time.perf_counter()
        released: set[int] = set()  # layers whose caches _release_layers replaced
        drop = ort_copies_initializers()
        prefetch = prefetch and drop
        with ThreadPoolExecutor(1, thread_name_prefix="llmc-stage-weights") as reader:
            pending = None
            for i, stage in enumerate(self.stages):
                t = time.perf_counter()
                weights = pending.result() if pending is not None else stage_weights(stage)
                session = self._session(stage, carried[0], weights, drop=drop)
                del weights
                if prefetch and i + 1 < len(self.stages):
                    pending = reader.submit(stage_weights, self.stages[i + 1])
                self.session_seconds += time.perf_counter() - t
                t = time.perf_counter()
                self._run_stage(session, stage, i, carried, feeds, pool, state, last_use)
                self.run_seconds += time.perf_counter() - t
                del session
                if stage.index >= 0:
                    self._release_layers(pool, stage.index, released)
                if drop:
                    release_freed_memory()
                elapsed = time.perf_counter() - start
                if elapsed >= self.PROGRESS_S and (i + 1) % max(1, len(self.stages) // 8) == 0:
                    from llmc.memory import rss_gb

                    self.say(f"        {self.name}: stage {i + 1}/{len(self.stages)} of {len(windows)} windows, "
                             f"{elapsed:.0f}s, {rss_gb():.1f} GB resident")
        out: list[np.ndarray] = []
        for g, values in zip(groups, carried, strict=True):
            logits = values.pop(self.output)
            if len(g) == 1:
                out.append(logits)
            else:  # owned copies: a window's rows alone, not a view keeping the group's logits alive
                out.extend(np.array(x) for x in np.split(logits, np.cumsum([len(windows[i]) for i in g])[:-1]))
        return out

    def _session(self, stage: Stage, carried: dict[str, np.ndarray], weights: StageWeights, drop: bool):
        """The stage's session; with ``drop`` (ONNX Runtime holds its own copies) the external arrays are freed."""
        from llmc.runtime.workers.ort.session import OrtSession

        blob, external = stage_model(self.model, stage, carried, weights)
        session = OrtSession(blob, custom_ops=self.custom_ops, spin=False, initializers=external)
        if drop:
            external.clear()  # the dict the session keeps: ONNX Runtime no longer reads these arrays
        return session

    def _run_stage(self, session, stage: Stage, i: int, carried: list[dict[str, np.ndarray]],
                   feeds: list[dict[str, np.ndarray]], pool, state, last_use: dict[str, int]) -> None:
        """Every group of windows through stage ``i``: its outputs added to ``carried``, values read for the last
        time dropped."""
        wanted = [v.name for v in stage.outputs]
        for w, values in enumerate(carried):
            inputs = {name: (values[name] if name in values else feeds[w][name]) for name in session.input_names}
            # Copies, and no name left holding the originals: ONNX Runtime's outputs are views of its session's
            # memory arena and would keep the whole arena (an FP8 stage's dequantized weights: ~2 GB on an 8B
            # layer) alive after the session, while they are carried.
            values.update((name, np.array(r)) for name, r in
                          zip(wanted, session.run(inputs, pool, outputs=wanted, state=state), strict=True))
            for name in [n for n in values if last_use.get(n, -1) <= i and n != self.output]:
                del values[name]
