"""What a pass is: a named, in-place rewrite of an ``onnx_ir.Model`` that reports statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir


@dataclass(frozen=True)
class GraphPass:
    """One pass.

    ``run`` rewrites the model in place and returns its own statistics (at least ``matches``).
    ``requires`` names passes that must run earlier when this one runs (the pipeline checks);
    ``guarantees`` names properties the graph has afterwards, for passes and backends to rely on.
    ``fusion`` marks passes that only make the engine faster (``--disable-pass all-fusions``).
    """

    name: str
    run: Callable[[ir.Model], dict[str, int]]
    description: str
    requires: tuple[str, ...] = ()
    guarantees: tuple[str, ...] = ()
    fusion: bool = True


def count_nodes(model: ir.Model) -> int:
    """Nodes in the main graph and every subgraph."""
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def apply(graph_pass: GraphPass, model: ir.Model) -> dict[str, int]:
    """Run one pass and add graph-level statistics: nodes before/after, removed and added."""
    # The nodes themselves are held until the count: a node the pass removes and frees could otherwise lend its
    # address (its id) to one the pass creates, which then counted as neither removed nor added. That made
    # fold-constants' counts, and with them two clean builds' manifests, differ now and then.
    nodes_before = list(ir.traversal.RecursiveGraphIterator(model.graph))
    before = {id(n) for n in nodes_before}
    stats = dict(graph_pass.run(model))
    after = {id(n) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
    stats.update(
        nodes_before=len(before),
        nodes_after=len(after),
        nodes_removed=len(before - after),
        nodes_added=len(after - before),
    )
    del nodes_before
    return stats


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Make every consumer (and the graph output, if ``old`` is one) read ``new``; ``new`` takes
    ``old``'s name, shape and type so graph signatures and readable names survive rewrites."""
    name, shape, vtype = old.name, old.shape, old.type
    old.name = f"{name}.replaced"
    new.name = name
    if new.shape is None:
        new.shape = shape
    if new.type is None:
        new.type = vtype
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)


def remove_unused(model: ir.Model) -> None:
    """Drop the nodes and initializers nothing reads any more (what a fusion left behind)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    graph = model.graph
    unused = [k for k, v in graph.initializers.items()
              if not v.uses() and not v.is_graph_output() and not v.is_graph_input()]
    for name in unused:
        del graph.initializers[name]
