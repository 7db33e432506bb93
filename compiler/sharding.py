"""Tensor parallelism: the CUDA engine's lowered program split into N rank programs.

The approach is TensorRT-LLM AutoDeploy's (``transform/library/sharding.py``), applied to the fused graph
as the CUDA backend lowers it (a flat node list whose weights are still lazy): every block of a decoder
layer runs between *column-parallel openers* (Q/K/V, gate/up; fused openers split by their fused output
sizes) and one *row-parallel closer* (o_proj, down_proj) whose output meets the residual stream. Each rank
keeps its share of the openers' output columns and the matching rows of the closer, and an ``AllReduce``
node after the closer sums the ranks' partial outputs. The embedding table and the LM head are vocab-parallel
when the vocabulary divides (a token's row looked up on its rank, zeros elsewhere, all-reduced; the logits
all-gathered); everything else outside a block (norms, the router) is replicated.

- Attention: each rank owns ``num_heads / N`` query heads and ``num_kv_heads / N`` KV heads; with fewer KV
  heads than ranks each KV head is replicated on ``N / num_kv_heads`` ranks (the ranks whose query heads read
  it). Head counts in node attributes and reshape shapes are rewritten per rank.
- Multi-head latent attention (DeepSeek-V3): found as a block whose openers feed one another (q_b_proj and
  kv_b_proj read a latent that the fused q_a_proj + kv_a_proj_with_mqa made). The parts that flow into attention
  directly are split by heads (q_b_proj or q_proj and kv_b_proj columns, o_proj rows); the latent projections,
  their norms and the rotary key are computed whole on every rank, the key widened over the rank's heads.
- MoE: the router is replicated; each expert's intermediate columns are split (default), or with ``--ep``
  whole experts are placed on the ranks (expert parallelism, ids localised, other ranks' pairs zeroed). Shared
  experts split like a dense MLP, and their partial sum joins the experts' one all-reduce.
- INT4 linears split along whole groups and FP8 linears carry their per-channel scales with their columns,
  so a quantization group never straddles two ranks.
- What is not handled is refused before any work is written, naming it: norms over a whole sharded width,
  ops with unknown semantics inside a block, MoE layers in other forms.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import UnsupportedError

ALL_REDUCE = "AllReduce"
_LINEARS = ("MatMul", "Fp8Linear", "Int4Linear")
# Ops inside a block that act on each feature (or each head) alone: they run unchanged on a rank's share.
_ELEMENTWISE = {"SwiGLU", "Gelu", "FastGelu", "Relu", "Sigmoid", "Tanh", "Mul", "Add", "Sub", "Div", "Softplus",
                "Neg", "Cast", "Identity", "Erf", "Pow", "Sqrt", "Where", "Clip", "Max", "Min", "Exp", "Log"}
# Ops that rewrite per rank (head counts, shapes, split sizes).
_HANDLED = {"Reshape", "Split", "RotaryEmbedding", "RMSNormalization", "PagedAttention", "Transpose", "Gather"}
_ST_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1}


@dataclass
class ShardedWeight:
    """One rank's share of a weight: the full weight's bytes, cut along ``axis`` at ``index`` (None: whole)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes]


@dataclass
class RankProgram:
    rank: int
    nodes: list[dict]
    weights: dict[str, ShardedWeight]
    sharded_bytes: int = 0  # bytes of the weights this rank holds a share of


@dataclass
class ShardPlan:
    world: int
    ranks: list[RankProgram]
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replicated: int  # ranks that hold each KV head (1: split)
    all_reduces: int
    layout: dict = field(default_factory=dict)  # what is replicated / split, for the manifest


def _cut(produce: Callable[[], bytes], dtype: str, shape: tuple[int, ...], axis: int,
         index: np.ndarray) -> Callable[[], bytes]:
    """Bytes of ``weight[..., index, ...]`` (along ``axis``), whatever the element type (cut as raw bytes)."""
    size = _ST_SIZE[dtype]

    def run() -> bytes:
        raw = np.frombuffer(produce(), np.uint8).reshape(*shape, size)
        return np.ascontiguousarray(np.take(raw, index, axis=axis)).tobytes()
    return run


def _consts(dtype: str, values: list[int]) -> Callable[[], bytes]:
    data = np.asarray(values, np.int64 if dtype == "I64" else np.int32).tobytes()
    return lambda: data


class _Graph:
    def __init__(self, nodes: list[dict], weights: dict) -> None:
        self.nodes, self.weights = nodes, weights
        self.producer: dict[str, int] = {}
        self.users: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for o in n["outputs"]:
                self.producer[o] = i
            for v in n["inputs"]:
                if v:
                    self.users.setdefault(v, []).append(i)
        act = {"input_ids"}
        for n in nodes:  # values computed from the token ids (not from positions or constants)
            if any(v in act for v in n["inputs"]):
                act.update(n["outputs"])
        self.act = act

    def is_linear(self, i: int) -> bool:
        n = self.nodes[i]
        return n["op"] in _LINEARS and len(n["inputs"]) > 1 and n["inputs"][1] in self.weights


# Where a walk back from a linear's input stops being a block: the residual stream (norms that add it, the
# embedding lookup, the last-token gather).
_BARRIERS = {"SkipRMSNormalization", "SkipLayerNormalization", "LayerNormalization", "GatherND"}


def _blocks(g: _Graph) -> list[tuple[list[int], set[int], int]]:
    """Every (openers, interior nodes, closer) block. A linear closes a block when the walk back from its input,
    over activations only, reaches linears (the openers) before any barrier of the residual stream; the nodes it
    passes are the block's interior."""
    out = []
    for c in range(len(g.nodes)):
        if not g.is_linear(c) or g.nodes[c]["inputs"][0] not in g.act:
            continue
        interior: set[int] = set()
        openers: list[int] = []
        stack, ok = [g.nodes[c]["inputs"][0]], True
        while stack and ok:
            p = g.producer.get(stack.pop())
            if p is None or p in interior or p in openers:
                continue
            n = g.nodes[p]
            if g.is_linear(p):
                openers.append(p)
            elif n["op"] in _BARRIERS or (n["op"] == "Gather" and n["inputs"][0] in g.weights):
                ok = False
            else:
                interior.add(p)
                stack.extend(x for x in n["inputs"] if x and x in g.act)
        if ok and openers and interior:
            out.append((sorted(openers), interior, c))
    return out


def shard(nodes: list[dict], weights: dict, world: int, experts: str = "split") -> ShardPlan:
    """Split a lowered CUDA program (``nodes``, ``weights``: name -> object with dtype/shape/produce) into
    ``world`` rank programs. ``experts``: ``split`` (each MoE expert's intermediate columns divided over the ranks)
    or ``whole`` (expert parallelism: each rank holds ``experts / world`` whole experts). Raises UnsupportedError,
    naming the reason, for anything it cannot split."""
    if experts not in ("split", "whole"):
        raise ValueError(experts)
    if world < 1 or world & (world - 1):
        raise UnsupportedError(f"--tp {world}: tensor parallelism takes 1, 2, 4 or 8 ranks")
    g = _Graph(nodes, weights)
    attn = [n for n in nodes if n["op"] == "PagedAttention"]
    if not attn:
        raise UnsupportedError("--tp: this program has no attention layers to split")
    heads = {int(n["attrs"]["num_heads"]) for n in attn}
    kv_heads = {int(n["attrs"]["num_kv_heads"]) for n in attn}
    if len(heads) != 1 or len(kv_heads) != 1:
        raise UnsupportedError(f"--tp {world}: layers with different head counts ({sorted(heads)} query, "
                               f"{sorted(kv_heads)} KV) are not split yet; build with --tp 1")
    h, kv = heads.pop(), kv_heads.pop()
    if h % world:
        raise UnsupportedError(f"--tp {world}: the model's {h} attention heads do not divide into {world} ranks; "
                               f"choose a --tp that divides {h}")
    if kv >= world and kv % world:
        raise UnsupportedError(f"--tp {world}: the model's {kv} KV heads do not divide into {world} ranks; choose a "
                               f"--tp that divides {kv} or a multiple of it")
    if kv < world and world % kv:
        raise UnsupportedError(f"--tp {world}: {kv} KV heads cannot be replicated evenly over {world} ranks "
                               f"({world} is not a multiple of {kv}); choose a --tp that is")
    for n in nodes:
        if n["op"] == "LoraApply":
            raise UnsupportedError(f"--tp {world}: LoRA slots are not split across ranks yet; build without "
                                   "--lora-slots or with --tp 1")
    blocks = _blocks(g)
    mla = _mla_blocks(g, blocks)
    nested = {o for m in mla.values() for o in m.split_openers}
    blocks = [b for b in blocks if b[2] not in nested]  # q_b_proj / kv_b_proj: MLA's openers, not closers
    moe = _moe_blocks(g)
    expert_gathers = [n for n in nodes if n["op"] == "GatherND" and n["inputs"][0] in g.weights
                      and len(g.weights[n["inputs"][0]].shape) == 3]
    if any(n["op"] == "TopK" for n in nodes) and (not moe or 2 * len(moe) != len(expert_gathers)):
        raise UnsupportedError(f"--tp {world}: this model's mixture-of-experts layers are not in the form llmc "
                               "splits (a gathered [experts, 2*intermediate, hidden] gate/up and [experts, hidden, "
                               "intermediate] down projection); build with --tp 1")
    shared = _shared_expert_blocks(g, blocks, moe)
    if len(blocks) - len(shared) + len(moe) != 2 * len(attn):
        raise UnsupportedError(f"--tp {world}: found {len(blocks) - len(shared) + len(moe)} column/row-parallel "
                               f"blocks for {len(attn)} attention layers (expected one attention and one MLP block per "
                               "layer); this architecture's layers are not split yet; build with --tp 1")
    vocab = _vocab_parallel(g, blocks, world)
    ranks = []
    reps = max(1, world // kv)
    for r in range(world):
        ranks.append(_rank(g, blocks, moe, mla, shared, r, world, h, kv, experts, vocab))
    attention = "heads split, KV heads " + (f"replicated on {reps} ranks each" if reps > 1 else "split")
    if mla:
        attention = ("multi-head latent attention: q_b_proj/q_proj and kv_b_proj columns split by heads, the "
                     "compressed latent (q_a_proj, kv_a_proj_with_mqa, their norms, the rotary key) replicated")
    split_vocab = "vocab-parallel: rank r holds rows [r V/N, (r+1) V/N)"
    layout = {"attention": attention, "mlp": "intermediate columns split",
              "embeddings": (f"{split_vocab}; a token's row is looked up on its rank, zeros elsewhere, then "
                             "all-reduced" if vocab.embeddings else "replicated"),
              **({"experts": EXPERT_LAYOUT[experts]} if moe else {}),
              **({"shared_experts": "intermediate columns split; summed with the routed experts by one all-reduce"}
                 if shared else {}),
              "lm_head": (f"{split_vocab} of its output columns; the logits all-gathered" if vocab.head is not None
                          else "replicated"),
              "all_reduce_after": "o_proj and down_proj (row-parallel)"}
    return ShardPlan(world, ranks, h // world, max(1, kv // world), reps,
                     len(blocks) - len(shared) + len(moe) + len(vocab.embeddings), layout)


@dataclass
class _Vocab:
    """The vocabulary-sized tables split by rows over the ranks (vocab-parallel), when the vocabulary divides."""

    size: int = 0
    embeddings: list[int] = field(default_factory=list)  # Gather nodes of the token-embedding table
    head: int | None = None  # the LM head's linear


def _vocab_parallel(g: _Graph, blocks, world: int) -> _Vocab:
    """The token-embedding lookups (``Gather(table [V, H], ids)`` of the token ids) and the LM head (the linear
    outside every block whose output has V columns), split by vocabulary rows when V divides into the ranks; a
    table anything else reads (a tied embedding read as a weight elsewhere) stays replicated."""
    in_blocks = {i for openers, _, closer in blocks for i in (*openers, closer)}
    ids = {"input_ids"}
    for n in g.nodes:  # the token ids and their reshapes, not values computed from the embeddings
        if n["op"] in ("Unsqueeze", "Reshape", "Squeeze", "Cast") and n["inputs"][0] in ids:
            ids.update(n["outputs"])
    emb = [i for i, n in enumerate(g.nodes) if n["op"] == "Gather" and n["inputs"][0] in g.weights
           and n["inputs"][1] in ids and int(n["attrs"].get("axis", 0)) == 0
           and len(g.weights[n["inputs"][0]].shape) == 2]
    if len(emb) != 1:
        return _Vocab()
    table = g.nodes[emb[0]]["inputs"][0]
    v = int(g.weights[table].shape[0])
    if v % world or len(g.users.get(table, [])) != 1:
        return _Vocab()
    heads = [i for i, n in enumerate(g.nodes) if g.is_linear(i) and i not in in_blocks and _out_width(g, i) == v]
    return _Vocab(v, emb, heads[0] if len(heads) == 1 else None)


def _vocab_rank(g: _Graph, nodes: list[dict], vocab: _Vocab, r: int, world: int, cut, new_weight,
                inserted: list) -> None:
    """This rank's rows of the vocabulary: the embedding lookup of the tokens it holds (a localised id, the row
    masked to zero for other ranks' tokens, then the all-reduce that sums the one nonzero row of each token:
    exact) and the LM head's columns of them (the logits all-gathered in rank order)."""
    per = vocab.size // world
    rows = np.arange(r * per, (r + 1) * per, dtype=np.int64)
    for i in vocab.embeddings:
        n = nodes[i]
        table, ids = n["inputs"]
        out = n["outputs"][0]
        tag = f"{out}@vocab{r}"

        def const(name: str, values: list[int], shape, table=table) -> str:
            return new_weight(f"{table}.{name}", f"{r}", "I64", shape, _consts("I64", values))

        inserted.append((i - 1, [
            {"op": "Sub", "inputs": [ids, const("vocab_first", [r * per], ())], "outputs": [f"{tag}.d"], "attrs": {}},
            {"op": "Max", "inputs": [f"{tag}.d", const("vocab_zero", [0], ())], "outputs": [f"{tag}.lo"],
             "attrs": {}},
            {"op": "Min", "inputs": [f"{tag}.lo", const("vocab_last", [per - 1], ())], "outputs": [f"{tag}.id"],
             "attrs": {}},
            {"op": "Equal", "inputs": [f"{tag}.id", f"{tag}.d"], "outputs": [f"{tag}.mine"], "attrs": {}},
            {"op": "Cast", "inputs": [f"{tag}.mine"], "outputs": [f"{tag}.m"], "attrs": {"to": "float32"}},
            {"op": "Unsqueeze", "inputs": [f"{tag}.m", const("vocab_axis", [-1], (1,))], "outputs": [f"{tag}.mask"],
             "attrs": {}},
        ]))
        n["inputs"] = [cut(table, 0, rows, f"v{r}"), f"{tag}.id"]
        n["outputs"] = [f"{tag}.rows"]
        inserted.append((i, [
            {"op": "Mul", "inputs": [f"{tag}.rows", f"{tag}.mask"], "outputs": [f"{out}@partial"], "attrs": {}},
            {"op": ALL_REDUCE, "inputs": [f"{out}@partial"], "outputs": [out], "attrs": {}},
        ]))
    if vocab.head is not None:
        n = nodes[vocab.head]
        _cut_opener(n, rows, cut, g, world)
        out = n["outputs"][0]
        n["outputs"][0] = f"{out}@vocab"
        inserted.append((vocab.head, [{"op": "AllGather", "inputs": [f"{out}@vocab"], "outputs": [out],
                                       "attrs": {"axis": -1}}]))


def _head_cols(heads: list[int], d: int) -> np.ndarray:
    return np.concatenate([np.arange(x * d, (x + 1) * d) for x in heads]).astype(np.int64)


def _moe_blocks(g: _Graph) -> list[tuple[int, int, str]]:
    """Mixture-of-experts layers as the frontend traces them (transformers' grouped experts): per (token, expert)
    pair ``GatherND(gate_up [E, 2I, H], ids)`` times the token, split into gate and up halves, the activation,
    ``GatherND(down [E, H, I], ids)`` times that, weighted and summed. -> (gate/up gather, down gather, the value
    the residual stream receives)."""
    out = []
    gathers = [i for i, n in enumerate(g.nodes) if n["op"] == "GatherND" and n["inputs"][0] in g.weights
               and len(g.weights[n["inputs"][0]].shape) == 3]
    for a, b in zip(gathers[0::2], gathers[1::2], strict=False):
        up, down = g.weights[g.nodes[a]["inputs"][0]].shape, g.weights[g.nodes[b]["inputs"][0]].shape
        if not (up[0] == down[0] and up[1] == 2 * down[2] and up[2] == down[1]):
            return []
        v = g.nodes[b]["outputs"][0]
        while True:  # forward from the down projection to the residual stream
            users = g.users.get(v, [])
            if len(users) != 1:
                return []
            if g.nodes[users[0]]["op"] in _BARRIERS:
                break
            v = g.nodes[users[0]]["outputs"][0]
        out.append((a, b, v))
    return out


@dataclass
class _MlaBlock:
    """One multi-head latent attention layer's block (keyed by its closer, o_proj): the openers split by heads
    (q_b_proj or q_proj, kv_b_proj), the fused opener parts that stay whole on every rank (the latent
    projections), and the nodes whose values carry heads (rewritten per rank)."""

    attention: int
    split_openers: list[int]
    parts: dict[str, bool]  # an opener output (or Split part) -> split by heads (else replicated)
    opener_parts: dict[int, list[str]]  # a split opener -> its output, or the parts of the Split that unfuses it
    region: list[int]  # nodes between the split parts and the closer, in program order
    broadcasts: list[int]  # Expand nodes that widen a replicated value (the rotary key) over the heads


def _reaches_attention(g: _Graph, value: str, stop_at_expand: bool) -> bool:
    """Whether ``value`` flows into an attention input (query/key/value) without passing a linear (or an Expand)."""
    stack, seen = [value], set()
    while stack:
        for u in g.users.get(stack.pop(), []):
            n = g.nodes[u]
            if u in seen or g.is_linear(u) or (stop_at_expand and n["op"] == "Expand"):
                continue
            seen.add(u)
            if n["op"] == "PagedAttention":
                return True
            stack.extend(n["outputs"])
    return False


def _mla_blocks(g: _Graph, blocks) -> dict[int, _MlaBlock]:
    """The attention blocks whose openers feed one another (closer -> block): multi-head latent attention, where
    the query and the per-head keys/values come from linears (q_b_proj, kv_b_proj) applied to a compressed latent
    that another opener (q_a_proj + kv_a_proj_with_mqa, fused) computed. An opener part is split by heads when it
    flows into attention directly; the latent parts, and the rotary key that an Expand widens over the heads,
    stay whole."""
    out = {}
    for openers, interior, closer in blocks:
        attn = [i for i in interior if g.nodes[i]["op"] == "PagedAttention"]
        if len(attn) != 1:
            continue
        parts: dict[str, bool] = {}
        opener_parts = {o: _parts(g, o, interior) for o in openers}
        for o in openers:
            for part in opener_parts[o]:
                parts[part] = _reaches_attention(g, part, stop_at_expand=True)
        fed = [o for o in openers if _fed_by(g, o) & set(openers)]
        if not fed:
            continue  # an ordinary attention block
        split_openers = [o for o in openers if any(parts[p] for p in opener_parts[o])]
        region: set[int] = set()
        stack = [p for p, split in parts.items() if split]
        while stack:
            for u in g.users.get(stack.pop(), []):
                if u in interior and u not in region:
                    region.add(u)
                    stack.extend(g.nodes[u]["outputs"])
        broadcasts = sorted({g.producer[v] for i in region for v in g.nodes[i]["inputs"] if v in g.producer and
                             g.producer[v] not in region and g.nodes[g.producer[v]]["op"] == "Expand"})
        out[closer] = _MlaBlock(attn[0], split_openers, parts, {o: opener_parts[o] for o in split_openers},
                                sorted(region), broadcasts)
    return out


def _fed_by(g: _Graph, i: int) -> set[int]:
    """The linears whose outputs reach linear ``i``'s input through other ops only (none past the residual)."""
    out, stack, seen = set(), [g.nodes[i]["inputs"][0]], set()
    while stack:
        p = g.producer.get(stack.pop())
        if p is None or p in seen:
            continue
        seen.add(p)
        if g.is_linear(p):
            out.add(p)
        elif g.nodes[p]["op"] not in _BARRIERS:
            stack.extend(v for v in g.nodes[p]["inputs"] if v and v in g.act)
    return out


def _parts(g: _Graph, o: int, interior: set[int]) -> list[str]:
    y = g.nodes[o]["outputs"][0]
    split = [u for u in g.users.get(y, []) if g.nodes[u]["op"] == "Split" and u in interior]
    return g.nodes[split[0]]["outputs"] if split else [y]


def _shared_expert_blocks(g: _Graph, blocks, moe) -> set[int]:
    """Closers of dense MLPs beside routed experts (DeepSeek's shared experts): their partial output is added to
    the experts' before the residual stream, so the experts' all-reduce sums both (one collective, not two)."""
    paths: set[int] = set()
    for _, b, v in moe:
        x = g.nodes[b]["outputs"][0]
        while x != v:
            (u,) = g.users[x]
            paths.add(u)
            x = g.nodes[u]["outputs"][0]
    out = set()
    for _, _, c in blocks:
        users = g.users.get(g.nodes[c]["outputs"][0], [])
        if len(users) == 1 and users[0] in paths and g.nodes[users[0]]["op"] == "Add":
            out.add(c)
    return out


# Ops that run unchanged on a rank's heads of a latent-attention block (its values are [.., heads, .., head dim]
# with the head dim last, or [tokens, heads x head dim]; each is checked not to act across heads).
_MLA_OPS = {"Reshape", "Transpose", "Split", "Slice", "Concat", "Expand", "Pad", "Gather", "Mul", "Add", "Sub",
            "Neg", "Cast", "Identity", "RotaryEmbedding", "RMSNormalization", "PagedAttention", "Unsqueeze"}


def _int_values(g: _Graph, name: str) -> list[int]:
    """The values of the int64 / int32 constant ``name`` (a shape, split sizes, axes)."""
    w = g.weights[name]
    return [int(v) for v in np.frombuffer(w.produce(), np.int64 if w.dtype == "I64" else np.int32)]


def _mla_rank(g: _Graph, nodes: list[dict], m: _MlaBlock, closer: int, q_heads: list[int], h: int, world: int,
              cut, new_weight) -> None:
    """Rewrite one latent-attention block for the rank that owns ``q_heads``: the split openers' head columns,
    head counts in shapes and attributes, the closer's rows of those heads."""
    dims = _mla_openers(g, nodes, m, q_heads, h, world, cut, new_weight)
    c = nodes[closer]
    rows = _in_width(g, closer)
    if rows % h:
        raise UnsupportedError(f"--tp {world}: {c['inputs'][1]}: {rows} rows are not {h} heads' worth; build with "
                               "--tp 1")
    dims.add(rows // h)
    dims.add(int(g.nodes[m.attention]["attrs"]["head_size"]))
    for i in m.region + m.broadcasts:
        _mla_node(g, nodes[i], q_heads, h, world, dims, cut, new_weight)
    _cut_closer(c, _head_cols(q_heads, rows // h), cut, g, world)


def _mla_openers(g: _Graph, nodes: list[dict], m: _MlaBlock, q_heads: list[int], h: int, world: int, cut,
                 new_weight) -> set[int]:
    """Cut the split openers to the rank's head columns (their latent parts whole); returns the per-head widths
    of the block's values (query/key, key+value, value) seen on the way."""
    dims: set[int] = set()
    for o in m.split_openers:
        node = nodes[o]
        parts = m.opener_parts[o]
        split = [g.producer[parts[0]]] if parts[0] != node["outputs"][0] else []
        sizes = _int_values(g, g.nodes[split[0]]["inputs"][1]) if split else [_out_width(g, o)]
        index, local, offset = [], [], 0
        for part, size in zip(parts, sizes, strict=True):
            if m.parts.get(part):
                if size % h:
                    raise UnsupportedError(f"--tp {world}: linear {node['inputs'][1]}: {size} columns are not "
                                           f"{h} heads' worth; build with --tp 1")
                dims.add(size // h)
                cols = _head_cols(q_heads, size // h)
            else:
                cols = np.arange(size, dtype=np.int64)  # the latent: every rank computes all of it
            index.append(cols + offset)
            local.append(len(cols))
            offset += size
        _cut_opener(node, np.concatenate(index), cut, g, world)
        if split:
            sn = nodes[split[0]]
            sn["inputs"][1] = new_weight(sn["inputs"][1], f"h{q_heads[0]}", "I64", (len(local),),
                                         _consts("I64", local))
    return dims


def _mla_node(g: _Graph, n: dict, q_heads: list[int], h: int, world: int, dims: set[int], cut, new_weight) -> None:
    """Rewrite one node of a latent-attention block for the rank's heads, or refuse one that may act across
    heads."""
    op = n["op"]
    local_h = len(q_heads)
    if op not in _MLA_OPS:
        raise UnsupportedError(f"--tp {world}: node {op} ({n['outputs'][0]}) inside a latent-attention block has "
                               "no per-rank form yet; build with --tp 1")
    if op in ("Reshape", "Expand"):
        _mla_shape(g, n, h, local_h, dims, new_weight)
    elif op in ("Slice", "Split", "Concat", "Gather"):  # along the head dim (last) or the batch axis only
        axes = (_int_values(g, n["inputs"][3]) if op == "Slice" and len(n["inputs"]) > 3 and n["inputs"][3] else
                [int(n["attrs"].get("axis", 0))])
        ok = all(a in (-1, 3) for a in axes) if op != "Gather" else axes == [0]
        if not ok:
            raise UnsupportedError(f"--tp: {op} {n['outputs'][0]} along axis {axes} may cross heads; build with "
                                   "--tp 1")
    elif op == "RotaryEmbedding" and int(n["attrs"].get("num_heads", 0)):
        n["attrs"]["num_heads"] = int(n["attrs"]["num_heads"]) // h * local_h
    elif op == "RMSNormalization":
        scale = g.weights.get(n["inputs"][1])
        if scale is not None and scale.shape and scale.shape[-1] not in dims:
            raise UnsupportedError(f"--tp {world}: {n['inputs'][1]} normalizes across heads; build with --tp 1")
    elif op == "PagedAttention":
        n["attrs"]["num_heads"] = n["attrs"]["num_kv_heads"] = local_h
        if len(n["inputs"]) > 7 and n["inputs"][7]:
            n["inputs"][7] = cut(n["inputs"][7], 0, np.asarray(q_heads, np.int64), f"h{q_heads[0]}")
    elif op in ("Mul", "Add", "Sub"):
        for v in n["inputs"]:
            w = g.weights.get(v)
            if w is not None and w.shape and int(np.prod(w.shape)) > 1 and w.shape[-1] not in dims:
                raise UnsupportedError(f"--tp {world}: {v} spans the heads of a latent-attention block; build "
                                       "with --tp 1")
    n["attrs"].pop("kernel", None)  # fused kernels were compiled for all heads: torch runs them


def _mla_shape(g: _Graph, n: dict, h: int, local_h: int, dims: set[int], new_weight) -> None:
    """A Reshape's or Expand's constant shape with the block's ``h`` heads replaced by the rank's ``local_h``."""
    op = n["op"]
    shape = _int_values(g, n["inputs"][1]) if n["inputs"][1] in g.weights else None
    if shape is None:
        raise UnsupportedError(f"--tp: {op.lower()} {n['outputs'][0]} takes a computed shape; build with "
                               "--tp 1")
    new = list(shape)
    at = [j for j, v in enumerate(shape) if v == h]
    if op == "Expand":  # the rotary key [1, 1, T, D] widened to [1, heads, T, D]
        if len(at) > 1:
            raise UnsupportedError(f"--tp: expand {n['outputs'][0]} to {shape}: which axis holds the {h} "
                                   "heads is ambiguous; build with --tp 1")
        if at:
            new[at[0]] = local_h
    elif len(shape) >= 2 and shape[-2] == h and shape[-1] in dims:  # [.., heads, head dim]
        new[-2] = local_h
    elif shape and any(shape[-1] == h * d for d in dims):  # [.., heads x head dim]
        new[-1] = shape[-1] // h * local_h
    elif at or any(v == h * d for v in shape for d in dims):
        raise UnsupportedError(f"--tp: reshape {n['outputs'][0]} to {shape} has no per-rank form; build "
                               "with --tp 1")
    if new != shape:
        n["inputs"][1] = new_weight(n["inputs"][1], "x".join(map(str, new)), g.weights[n["inputs"][1]].dtype,
                                    (len(new),), _consts(g.weights[n["inputs"][1]].dtype, new))


def _in_width(g: _Graph, i: int) -> int:
    n = g.nodes[i]
    w = g.weights[n["inputs"][1]]
    if n["op"] == "Fp8Linear":
        return int(w.shape[1])
    if n["op"] == "Int4Linear":
        return int(n["attrs"]["k"])
    return int(w.shape[0])


@dataclass
class _RankWeights:
    """One rank's weights while its program is rewritten: the graph's, plus the cuts and constants made for it,
    and the bytes of the cuts."""

    g: _Graph
    weights: dict
    sharded_bytes: int = 0

    def new_weight(self, base: str, tag: str, dtype: str, shape, produce, kind: str = "rank") -> str:
        name = f"{base}@{kind}{tag}"  # @shard: a cut of a weight; @rank: a constant rewritten for this rank
        self.weights[name] = ShardedWeight(name, dtype, tuple(int(s) for s in shape), produce)
        return name

    def cut(self, name: str, axis: int, index: np.ndarray, tag: str) -> str:
        w = self.g.weights[name]
        shape = list(w.shape)
        shape[axis] = len(index)
        out = self.new_weight(name, tag, w.dtype, shape, _cut(w.produce, w.dtype, tuple(w.shape), axis, index),
                              "shard")
        self.sharded_bytes += int(np.prod(shape)) * _ST_SIZE[w.dtype]
        return out


@dataclass
class _RankShare:
    """What one rank keeps of a block's values: per value, its global feature indices on this rank (``cols``, of
    the flattened last dim), that dim's global width and which attention input it is (``role``)."""

    r: int
    world: int
    h: int  # query heads of the whole model
    kv: int  # KV heads of the whole model
    q_heads: list[int]
    kv_heads: list[int]
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    width: dict[str, int] = field(default_factory=dict)
    role: dict[str, str] = field(default_factory=dict)


def _rank(g: _Graph, blocks, moe, mla, shared, r: int, world: int, h: int, kv: int, experts: str,
          vocab: _Vocab) -> RankProgram:
    nodes = [dict(n, inputs=list(n["inputs"]), outputs=list(n["outputs"]), attrs=dict(n["attrs"])) for n in g.nodes]
    rw = _RankWeights(g, dict(g.weights))
    cut, new_weight = rw.cut, rw.new_weight
    q_heads = list(range(r * h // world, (r + 1) * h // world))
    kv_heads = ([r * kv // world + i for i in range(kv // world)] if kv >= world else [r // (world // kv)])
    share = _RankShare(r, world, h, kv, q_heads, kv_heads)
    inserted: list[tuple[int, dict]] = []

    for openers, interior, closer in blocks:
        if closer in mla:
            _mla_rank(g, nodes, mla[closer], closer, q_heads, h, world, cut, new_weight)
            _all_reduce_after(nodes, closer, inserted)
            continue
        for o in openers:
            _shard_opener(g, nodes, o, interior, share, rw)
        _shard_interior(g, nodes, interior, share, rw)
        # the closer: this rank's rows, then the all-reduce of the partial sums
        c = nodes[closer]
        x = c["inputs"][0]
        _cut_closer(c, share.cols[x], cut, g, world)
        if closer not in shared:  # a shared expert's partial sum joins the routed experts' all-reduce
            _all_reduce_after(nodes, closer, inserted)
    for a, b, v in moe:  # one all-reduce of the weighted sum of this rank's share of the experts
        _shard_moe(g, nodes, a, b, v, r, world, experts, rw, inserted)
    _vocab_rank(g, nodes, vocab, r, world, cut, new_weight, inserted)
    # after node ``at``, in the order they were added (a list: several nodes in a row)
    for at, new in sorted(inserted, key=lambda t: t[0], reverse=True):
        nodes[at + 1:at + 1] = new if isinstance(new, list) else [new]
    used = {v for n in nodes for v in n["inputs"] if v}
    return RankProgram(r, nodes, {k: w for k, w in rw.weights.items() if k in used}, rw.sharded_bytes)


def _shard_opener(g: _Graph, nodes: list[dict], o: int, interior: set[int], share: _RankShare,
                  rw: _RankWeights) -> None:
    """Cut column-parallel opener ``o`` to the rank's columns: by heads for the parts that feed attention's query,
    key or value, by equal shares for the rest; its Split's sizes rewritten to the rank's."""
    r, world, h, kv = share.r, share.world, share.h, share.kv
    cols, width, role = share.cols, share.width, share.role
    node = nodes[o]
    y = node["outputs"][0]
    fused = y  # the fused output the Split reads: after the bias Add of a linear with a bias (qwen2)
    users = [u for u in g.users.get(y, []) if u in interior]
    if len(users) == 1 and nodes[users[0]]["op"] == "Add" and any(v in g.weights for v in
                                                                  nodes[users[0]]["inputs"]):
        fused = nodes[users[0]]["outputs"][0]
    split = [u for u in g.users.get(fused, []) if nodes[u]["op"] == "Split" and u in interior]
    parts = nodes[split[0]]["outputs"] if split else [y]
    if split:
        sizes = [int(v) for v in np.frombuffer(g.weights[nodes[split[0]]["inputs"][1]].produce(), np.int64)]
    else:
        sizes = [_out_width(g, o)]
    part_cols, offset = [], 0
    for part, size in zip(parts, sizes, strict=True):
        which = _role(g, part, interior)
        d = None
        if which in ("q", "k", "v"):
            d = size // (h if which == "q" else kv)
            local = _head_cols(share.q_heads if which == "q" else share.kv_heads, d)
        else:
            if size % world:
                raise UnsupportedError(f"--tp {world}: linear {node['inputs'][1]}: {size} output columns do "
                                       f"not divide into {world} ranks")
            local = np.arange(r * size // world, (r + 1) * size // world, dtype=np.int64)
        cols[part], width[part], role[part] = local, size, which
        part_cols.append(local + offset)
        offset += size
    all_cols = np.concatenate(part_cols)
    _cut_opener(node, all_cols, rw.cut, g, world)
    cols[y], width[y], role[y] = all_cols, offset, "packed"
    if split:
        sn = nodes[split[0]]
        sn["inputs"][1] = rw.new_weight(sn["inputs"][1], f"r{r}", "I64", (len(sizes),),
                                        _consts("I64", [len(cols[p]) for p in parts]))


def _shard_interior(g: _Graph, nodes: list[dict], interior: set[int], share: _RankShare, rw: _RankWeights) -> None:
    """Rewrite a block's nodes between its openers and its closer, in program order, for the rank's share: head
    counts, reshape shapes, constants that span the sharded width; refuse what has no per-rank form."""
    r, world, h, kv = share.r, share.world, share.h, share.kv
    cols, width, role = share.cols, share.width, share.role
    for i in sorted(interior):
        n = nodes[i]
        op = n["op"]
        ins = [v for v in n["inputs"] if v in cols]
        if op == "Split":
            continue  # its parts were assigned with the opener
        if op not in _ELEMENTWISE | _HANDLED:
            raise UnsupportedError(f"--tp {world}: node {op} ({n['outputs'][0]}) sits between a column-parallel "
                                   "and a row-parallel linear and has no per-rank form yet; build with --tp 1")
        src = ins[0]
        if op == "Gather" and (int(n["attrs"].get("axis", 0)) != 0 or n["inputs"][1] not in g.weights):
            raise UnsupportedError(f"--tp {world}: gather {n['outputs'][0]} inside a block picks along a sharded "
                                   "axis; build with --tp 1")
        if op == "Reshape":
            n["inputs"][1] = _reshape(n, g, cols[src], width[src], role[src], h, kv, r, rw.new_weight)
        elif op == "RotaryEmbedding":
            n["attrs"]["num_heads"] = int(n["attrs"]["num_heads"]) * len(cols[src]) // width[src]
        elif op == "RMSNormalization":
            scale = g.weights.get(n["inputs"][1])
            if scale is not None and scale.shape and scale.shape[-1] == width[src] != len(cols[src]):
                raise UnsupportedError(f"--tp {world}: {n['inputs'][1]} normalizes over all heads at once (a "
                                       "norm across the sharded width needs an all-reduce of its own); build with "
                                       "--tp 1")
        elif op == "PagedAttention":
            n["attrs"]["num_heads"] = len(share.q_heads)
            n["attrs"]["num_kv_heads"] = len(share.kv_heads)
            if len(n["inputs"]) > 7 and n["inputs"][7]:
                n["inputs"][7] = rw.cut(n["inputs"][7], 0, np.asarray(share.q_heads, np.int64), f"r{r}")
            q = n["inputs"][0]
            cols[n["outputs"][0]], width[n["outputs"][0]], role[n["outputs"][0]] = cols[q], width[q], "o"
            n["attrs"].pop("kernel", None)
            continue
        else:  # elementwise: slice constants that span the feature dim
            for j, v in enumerate(n["inputs"]):
                w = g.weights.get(v)
                if w is not None and w.shape and w.shape[-1] == width[src] and width[src] > 1:
                    n["inputs"][j] = rw.cut(v, len(w.shape) - 1, cols[src], f"r{r}")
        n["attrs"].pop("kernel", None)  # fused kernels were compiled for the full width: torch runs them
        for o in n["outputs"]:
            cols[o], width[o], role[o] = cols[src], width[src], role[src]


def _shard_moe(g: _Graph, nodes: list[dict], a: int, b: int, v: str, r: int, world: int, experts: str,
               rw: _RankWeights, inserted: list) -> None:
    """The rank's share of one MoE layer's experts (whole experts, or each expert's intermediate columns), then
    the all-reduce of their weighted sum ``v``."""
    if experts == "whole":
        _place_experts(g, nodes, a, b, r, world, rw.cut, rw.new_weight, inserted)
    else:  # every expert keeps 1/N of its intermediate columns
        up = g.weights[nodes[a]["inputs"][0]]
        i = int(up.shape[1]) // 2
        if i % world:
            raise UnsupportedError(f"--tp {world}: {nodes[a]['inputs'][0]}: {i} intermediate columns do not "
                                   f"divide into {world} ranks")
        local = np.arange(r * i // world, (r + 1) * i // world, dtype=np.int64)
        nodes[a]["inputs"][0] = rw.cut(nodes[a]["inputs"][0], 1, np.concatenate([local, local + i]), f"r{r}")
        nodes[b]["inputs"][0] = rw.cut(nodes[b]["inputs"][0], 2, local, f"r{r}")
        for n in nodes[a:b]:
            n["attrs"].pop("kernel", None)  # the fused activation was compiled for the full width
    p = g.producer[v]
    nodes[p]["outputs"][nodes[p]["outputs"].index(v)] = f"{v}@partial"
    inserted.append((p, {"op": ALL_REDUCE, "inputs": [f"{v}@partial"], "outputs": [v], "attrs": {}}))


EXPERT_LAYOUT = {"split": "each expert's intermediate columns split (router replicated)",
                 "whole": "whole experts partitioned, rank r holding experts [r E/N, (r+1) E/N) (expert parallelism: "
                          "router replicated, expert ids localised, other ranks' pairs masked to zero)"}


def _place_experts(g: _Graph, nodes: list[dict], a: int, b: int, r: int, world: int, cut, new_weight,
                   inserted: list) -> None:
    """Expert parallelism for one MoE layer: this rank keeps experts ``[r E/N, (r+1) E/N)`` whole. Every rank runs
    the replicated router, so every (token, expert) pair is computed on every rank from a localised id
    (``clamp(id - r E/N, 0, E/N - 1)``), and the pairs of other ranks' experts are zeroed (their down projection's
    input times 0): the weighted sum then holds this rank's experts only, and the all-reduce adds the ranks' sums.
    Exact: a pair's output is computed once, on its rank, and the other ranks add zeros."""
    up_name, down_name = nodes[a]["inputs"][0], nodes[b]["inputs"][0]
    e = int(g.weights[up_name].shape[0])
    ids = nodes[a]["inputs"][1]
    if e % world:
        raise UnsupportedError(f"--tp {world} --ep: {up_name}: {e} experts do not partition evenly over {world} "
                               f"ranks; choose a --tp that divides {e}")
    down_mm = [u for u in g.users.get(g.nodes[b]["outputs"][0], []) if g.nodes[u]["op"] == "MatMul"]
    if nodes[b]["inputs"][1] != ids or len(down_mm) != 1:
        raise UnsupportedError(f"--tp {world} --ep: {down_name}: the experts' down projection is not in the form "
                               "llmc places whole on ranks; build without --ep")
    per = e // world
    local = np.arange(r * per, (r + 1) * per, dtype=np.int64)
    nodes[a]["inputs"][0] = cut(up_name, 0, local, f"e{r}")
    nodes[b]["inputs"][0] = cut(down_name, 0, local, f"e{r}")
    w = g.weights[ids] if ids in g.weights else None
    if w is not None:
        raise UnsupportedError(f"--tp {world} --ep: {up_name} gathers constant experts; build without --ep")
    tag = f"{ids}@ep{r}"

    def const(name: str, values: list[int], shape) -> str:
        return new_weight(f"{up_name}.{name}", f"{r}", "I64", shape, _consts("I64", values))

    lid, mask = f"{tag}.local", f"{tag}.mask"
    inserted.append((a - 1, [
        {"op": "Sub", "inputs": [ids, const("ep_first", [r * per], ())], "outputs": [f"{tag}.d"], "attrs": {}},
        {"op": "Max", "inputs": [f"{tag}.d", const("ep_zero", [0], ())], "outputs": [f"{tag}.lo"], "attrs": {}},
        {"op": "Min", "inputs": [f"{tag}.lo", const("ep_last", [per - 1], ())], "outputs": [lid], "attrs": {}},
        {"op": "Equal", "inputs": [lid, f"{tag}.d"], "outputs": [f"{tag}.mine"], "attrs": {}},
        {"op": "Cast", "inputs": [f"{tag}.mine"], "outputs": [f"{tag}.m"], "attrs": {"to": "float32"}},
        {"op": "Reshape", "inputs": [f"{tag}.m", const("ep_shape", [-1, 1, 1], (3,))], "outputs": [mask],
         "attrs": {}},
    ]))
    nodes[a]["inputs"][1] = nodes[b]["inputs"][1] = lid
    mm = nodes[down_mm[0]]
    j = 1 if mm["inputs"][0] == g.nodes[b]["outputs"][0] else 0
    x = mm["inputs"][j]
    inserted.append((down_mm[0] - 1, [{"op": "Mul", "inputs": [x, mask], "outputs": [f"{x}@ep"], "attrs": {}}]))
    mm["inputs"][j] = f"{x}@ep"


def _all_reduce_after(nodes: list[dict], closer: int, inserted: list) -> None:
    c = nodes[closer]
    out = c["outputs"][0]
    c["outputs"][0] = f"{out}@partial"
    inserted.append((closer, {"op": ALL_REDUCE, "inputs": [f"{out}@partial"], "outputs": [out], "attrs": {}}))


def _out_width(g: _Graph, i: int) -> int:
    n = g.nodes[i]
    w = g.weights[n["inputs"][1]]
    return int(w.shape[0] if n["op"] == "Fp8Linear" else w.shape[-1])


def _role(g: _Graph, value: str, interior: set[int]) -> str:
    """q / k / v: the attention input the value reaches inside the block; mlp otherwise."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        for u in g.users.get(v, []):
            if u not in interior or u in seen:
                continue
            seen.add(u)
            n = g.nodes[u]
            if n["op"] == "PagedAttention":
                k = n["inputs"].index(v)
                if k < 3:
                    return "qkv"[k]
            stack.extend(n["outputs"])
    return "mlp"


def _cut_opener(node: dict, index: np.ndarray, cut, g: _Graph, world: int) -> None:
    op, ins = node["op"], node["inputs"]
    tag = f"c{zlib.crc32(index.tobytes()):08x}"  # deterministic: names enter the artifact digest
    if op == "MatMul":
        ins[1] = cut(ins[1], 1, index, tag)
    elif op == "Fp8Linear":  # [N, K] E4M3 + per-channel scales [N]: a channel's scale goes with it
        ins[1] = cut(ins[1], 0, index, tag)
        ins[2] = cut(ins[2], 0, index, tag)
    elif op == "Int4Linear":  # [K/2, N] codes, [K/g, N] scales (+ zeros): columns carry whole groups
        for j in range(1, len(ins)):
            if ins[j]:
                ins[j] = cut(ins[j], 1, index, tag)
        node["attrs"].pop("kernel", None)


def _cut_closer(node: dict, index: np.ndarray, cut, g: _Graph, world: int) -> None:
    op, ins = node["op"], node["inputs"]
    tag = f"r{zlib.crc32(index.tobytes()):08x}"
    if op == "MatMul":
        ins[1] = cut(ins[1], 0, index, tag)
    elif op == "Fp8Linear":  # rows of K: the per-output-channel scales stay whole
        ins[1] = cut(ins[1], 1, index, tag)
    elif op == "Int4Linear":
        group = int(node["attrs"]["group_size"])
        lo, n = int(index[0]), len(index)
        if not np.array_equal(index, np.arange(lo, lo + n)) or lo % group or n % group or lo % 2:
            raise UnsupportedError(f"--tp {world}: {ins[1]}: a rank's rows {lo}..{lo + n} would split an INT4 group "
                                   f"of {group}; build with a smaller --tp or group size")
        ins[1] = cut(ins[1], 0, np.arange(lo // 2, (lo + n) // 2), "r")
        for j in range(2, len(ins)):
            if ins[j]:
                ins[j] = cut(ins[j], 0, np.arange(lo // group, (lo + n) // group), "r")
        node["attrs"]["k"] = n
        node["attrs"].pop("kernel", None)


def _reshape(node: dict, g: _Graph, index: np.ndarray, full: int, role: str, h: int, kv: int, r: int,
             new_weight) -> str:
    name = node["inputs"][1]
    w = g.weights.get(name)
    if w is None:
        raise UnsupportedError(f"--tp: reshape {node['outputs'][0]} takes a computed shape; build with --tp 1")
    shape = [int(v) for v in np.frombuffer(w.produce(), np.int64 if w.dtype == "I64" else np.int32)]
    local = len(index)
    heads = h if role in ("q", "o") else kv if role in ("k", "v") else None
    new = list(shape)
    if shape and shape[-1] == full:
        new[-1] = local
    elif heads and len(shape) >= 2 and shape[-2] == heads and shape[-1] * heads == full:
        new[-2] = local // shape[-1]
    elif not (shape and shape[-1] * (heads or 0) == full):
        raise UnsupportedError(f"--tp: reshape {node['outputs'][0]} to {shape} of a sharded value of width {full} "
                               "has no per-rank form; build with --tp 1")
    if new == shape:
        return name
    return new_weight(name, "x".join(map(str, new)), w.dtype, (len(new),), _consts(w.dtype, new))


# Families whose traced layers the pass splits, each held to its one-rank engine (tests/test_tensor_parallel.py
# and the notes of issue 34). The others trace their Q/K/V differently: gpt2's fused c_attn, gpt_neox's per-head
# interleaved query_key_value, phi3's qkv_proj sliced by Slice nodes.
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v3")


def check_config(config: dict, world: int, where: str, int4_group: int | None = None, ep: bool = False) -> None:
    """What ``--tp world`` cannot split in this model, from its config alone (before any work). ``int4_group``:
    the group size of an INT4 recipe, whose groups along a row-parallel linear's inputs must not straddle ranks;
    ``ep``: experts placed whole on the ranks (``--ep``), which must partition evenly."""
    cfg = config.get("text_config", config)
    # a vision-language wrapper's language model is split as its text model's family (LLaVA's is a llama)
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else config.get("model_type")
    if ep:
        experts = next((cfg[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if cfg.get(k)), None)
        if not experts:
            raise UnsupportedError(f"{where}: --ep: model_type {model_type!r} has no mixture-of-experts layers to "
                                   "place on ranks; build without --ep")
        if experts % world:
            raise UnsupportedError(f"{where}: --tp {world} --ep: {experts} experts per layer do not partition evenly "
                                   f"over {world} ranks; choose a --tp that divides {experts}, or build without --ep")
    if world > 1 and model_type not in TP_FAMILIES:
        raise UnsupportedError(f"{where}: --tp {world}: model_type {model_type!r} is not split across ranks yet "
                               f"(tensor parallelism covers {', '.join(TP_FAMILIES)}); build with --tp 1")
    if int4_group and world > 1:
        h, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
        d = cfg.get("v_head_dim") if cfg.get("kv_lora_rank") else cfg.get("head_dim")  # o_proj reads V heads
        d = d or (hidden // h if h and hidden else None)
        shared = (cfg.get("moe_intermediate_size") or 0) * (cfg.get("n_shared_experts") or 0)
        widths = {"num_attention_heads x " + ("v_head_dim" if cfg.get("kv_lora_rank") else "head_dim") +
                  " (o_proj's inputs)": h * d if h and d else None,
                  "intermediate_size (down_proj's inputs)": cfg.get("intermediate_size"),
                  "moe_intermediate_size x n_shared_experts (the shared experts' down_proj inputs)": shared or None}
        for what, width in widths.items():
            if isinstance(width, int) and (width % world or (width // world) % int4_group):
                raise UnsupportedError(f"{where}: --tp {world} with INT4 groups of {int4_group}: {what} {width} gives "
                                       f"each rank {width / world:g} inputs, not whole groups; choose a --group-size "
                                       f"or --tp that divides it")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedError(f"{where}: --tp {world}: a gated shared expert (shared_expert_intermediate_size, "
                               "qwen2_moe's form) is not split across ranks yet; build with --tp 1")
    h = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or h
    if isinstance(h, int) and h % world:
        raise UnsupportedError(f"{where}: --tp {world}: num_attention_heads {h} does not divide into {world} ranks; "
                               f"choose a --tp that divides {h}")
    if isinstance(kv, int) and kv >= world and kv % world:
        raise UnsupportedError(f"{where}: --tp {world}: num_key_value_heads {kv} does not divide into {world} "
                               f"ranks; choose a --tp that divides {kv} or a multiple of it")
    if isinstance(kv, int) and kv < world and world % kv:
        raise UnsupportedError(f"{where}: --tp {world}: num_key_value_heads {kv} cannot be replicated evenly over "
                               f"{world} ranks ({world} is not a multiple of {kv}); choose a --tp that is")
