"""Differential verification of passes: run the graph before and after each pass on the same
fresh random step (ONNX Runtime, with the KV pool filled with random values) and fail, naming
the pass, when the logits move beyond tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from llmc.compiler.backends import onnxruntime as ort_backend
from llmc.errors import EXIT_INTERNAL, LlmcError


@dataclass
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    layers: list[dict] | None = None  # the manifest's kv_cache.layers (per-layer geometry), if any


def random_step(rng: np.random.Generator, vocab: int, kv: KVShape, num_blocks: int = 32):
    """A valid packed step over three sequences: a fresh prefill, a prefill chunk after cached
    context, and a decode token; plus a random KV pool for the cached positions."""
    bs = kv.block_size
    plan = [(0, 7), (9, 5), (20, 1)]  # (cached tokens, new tokens) per sequence
    perm = rng.permutation(num_blocks)
    ids, pos, slots, ctx, qsl, tables = [], [], [], [], [0], []
    nb = max(-(-(c + n) // bs) for c, n in plan)
    used = 0
    for cached, new in plan:
        blocks = perm[used : used + nb]
        used += nb
        p = np.arange(cached, cached + new)
        ids.append(rng.integers(0, vocab, new))
        pos.append(p)
        slots.append(blocks[p // bs] * bs + p % bs)
        ctx.append(cached + new)
        qsl.append(qsl[-1] + new)
        tables.append(blocks)
    feeds = {
        "input_ids": np.concatenate(ids).astype(np.int64),
        "positions": np.concatenate(pos).astype(np.int64),
        "slot_mapping": np.concatenate(slots).astype(np.int64),
        "block_tables": np.stack(tables).astype(np.int64),
        "context_lens": np.asarray(ctx, np.int64),
        "query_start_loc": np.asarray(qsl, np.int64),
        "logits_indices": np.asarray([qsl[1] - 1, 2, qsl[2] - 1, qsl[3] - 1], np.int64),
        # Graphs with length-dependent rotary factors (longrope): the first sequence short, the others
        # far past any threshold, so both factor sets are exercised. Other graphs do not take it.
        "rope_lengths": np.repeat(np.asarray([ctx[0], 1 << 30, 1 << 30], np.int64), [n for _, n in plan]),
    }
    from llmc.runtime.core.kv_cache import layer_geometry

    pool = []
    for i, (owner, heads, size) in enumerate(layer_geometry(kv.num_layers, kv.num_kv_heads, kv.head_size, kv.layers)):
        shape = (num_blocks, heads, bs, size)
        pool.append((rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
                    if owner == i else pool[owner])
    return feeds, pool


def run_graph(model: ir.Model, feeds: dict[str, np.ndarray], pool, fusions: frozenset[str] | None = None) -> np.ndarray:
    """Execute ``model`` (llmc ops lowered on a copy, with the backend ``fusions``: default all) in ONNX
    Runtime on a copy of ``pool``."""
    from llmc.runtime.workers.ort.session import OrtSession

    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    custom_ops = ort_backend.CUSTOM_OPS["native"]
    ort_backend.lower(copy, "native", fusions)
    # Run the graph as written: ORT's own rewrites would blur which pass changed what.
    session = OrtSession(ir.serde.serialize_model(copy).SerializeToString(), custom_ops=custom_ops,
                         optimize=False, spin=False)
    layers = [(k.copy(), v.copy()) for k, v in pool]
    names = set(session.input_names)
    return session.run({k: v for k, v in feeds.items() if k in names}, layers)


# Passes that change the numerics on purpose (llmc.quant.stage's quantization pass): their logit
# change is recorded, not judged (the build's accuracy report on held-out text judges it), and the
# passes after them are checked strictly against their output.
INEXACT_PASSES = ("quantize",)


class PassVerifier:
    """Callable for :func:`llmc.compiler.pipeline.run_pipeline`: checks each pass against the
    previous graph and against the unoptimised one, relative error ``max|a-b| / max|b|``."""

    def __init__(self, model: ir.Model, vocab: int, kv: KVShape, rtol: float = 1e-5, seed: int | None = None,
                 inexact: tuple[str, ...] = INEXACT_PASSES):
        self.rng = np.random.default_rng(seed)
        self.feeds, self.pool = random_step(self.rng, vocab, kv)
        # A LoRA engine's inputs (llmc.passes.lora): random adapters in every slot, tokens of every slot and none.
        tokens = len(self.feeds["input_ids"])
        for v in model.graph.inputs:
            if v.name == "lora_slots":
                self.feeds[v.name] = self.rng.integers(-1, 4, tokens).astype(np.int64)
            elif v.name.endswith((".lora_A", ".lora_B")):
                shape = [int(d) for d in v.shape]
                self.feeds[v.name] = (0.1 * self.rng.standard_normal(shape)).astype(np.float32)
        self.rtol = rtol
        self.reference = run_graph(model, self.feeds, self.pool)
        self.previous = self.reference
        self.errors: dict[str, float] = {}
        self.inexact = inexact

    def __call__(self, pass_name: str, model: ir.Model) -> None:
        out = run_graph(model, self.feeds, self.pool)
        if pass_name in self.inexact and out.shape == self.previous.shape:
            self.errors[pass_name] = float(np.abs(out - self.previous).max() / np.abs(self.previous).max())
            self.previous = self.reference = out
            return
        for against, ref in (("the graph before it", self.previous), ("the unoptimised graph", self.reference)):
            if out.shape != ref.shape:
                raise LlmcError(f"--verify-passes: pass {pass_name!r} changed output 'logits' shape from "
                                f"{ref.shape} to {out.shape}", exit_code=EXIT_INTERNAL)
            err = float(np.abs(out - ref).max() / max(float(np.abs(ref).max()), 1e-30))
            if not err <= self.rtol:
                raise LlmcError(
                    f"--verify-passes: pass {pass_name!r} changed the numerics: output 'logits' differs from "
                    f"{against} by max relative error {err:.3g} (tolerance {self.rtol:g}); "
                    f"build with --disable-pass {pass_name} and report the bug",
                    exit_code=EXIT_INTERNAL,
                )
        self.errors[pass_name] = float(np.abs(out - self.reference).max() / np.abs(self.reference).max())
        self.previous = out
