"""Per-call overhead of the ONNX Runtime → PagedAttention bridge (onnxruntime-extensions Python op).

A graph of ``--layers`` chained PagedAttention nodes runs one decode step (T = batch rows) in
ONNX Runtime; the same kernel is then called directly from Python as many times. The difference,
per node, is what the bridge costs on top of the kernel: paid once per layer per step.

    python benchmarks/bench_ort_bridge.py [--layers 30] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.plugins.paged_attention import kv_binding, ort_op
from llmc.plugins.paged_attention.cpu import paged_attention_cpu

REPO = Path(__file__).resolve().parent.parent


def _graph(layers: int, hq: int, hkv: int, d: int) -> bytes:
    meta = ["slot_mapping", "block_tables", "context_lens", "query_start_loc"]
    nodes, x = [], "q"
    for i in range(layers):
        nodes.append(helper.make_node(
            "PagedAttention", [x, "k", "v", *meta], [f"o{i}"], domain=ort_op.ORT_DOMAIN, layer_idx=i,
            num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d**-0.5, sliding_window=0, softcap=0.0))
        x = f"o{i}"
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, ["T", hq * d]),
              helper.make_tensor_value_info("k", f, ["T", hkv * d]),
              helper.make_tensor_value_info("v", f, ["T", hkv * d])]
    inputs += [helper.make_tensor_value_info(m, TensorProto.INT64, None) for m in meta]
    g = helper.make_graph(nodes, "bridge", inputs, [helper.make_tensor_value_info(x, f, ["T", hq * d])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(ort_op.ORT_DOMAIN, 1)])
    return m.SerializeToString()


def measure(layers: int, batch: int, ctx: int, hq=9, hkv=3, d=64, block=16, reps=200) -> dict:
    rng = np.random.default_rng(0)
    blocks_per_seq = -(-ctx // block)
    nblocks = batch * blocks_per_seq
    pool = [(rng.standard_normal((nblocks, hkv, block, d), dtype=np.float32),
             rng.standard_normal((nblocks, hkv, block, d), dtype=np.float32)) for _ in range(layers)]
    tables = np.arange(nblocks, dtype=np.int64).reshape(batch, blocks_per_seq)
    feeds = {
        "q": rng.standard_normal((batch, hq * d), dtype=np.float32),
        "k": rng.standard_normal((batch, hkv * d), dtype=np.float32),
        "v": rng.standard_normal((batch, hkv * d), dtype=np.float32),
        "slot_mapping": tables[:, (ctx - 1) // block] * block + (ctx - 1) % block,
        "block_tables": tables,
        "context_lens": np.full(batch, ctx, np.int64),
        "query_start_loc": np.arange(batch + 1, dtype=np.int64),
    }
    so = ort.SessionOptions()
    so.register_custom_ops_library(ort_op.library_path())
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(_graph(layers, hq, hkv, d), so, providers=["CPUExecutionProvider"])
    with kv_binding.bound_pool(pool):
        sess.run(None, feeds)
        t = time.perf_counter()
        for _ in range(reps):
            sess.run(None, feeds)
        ort_us = (time.perf_counter() - t) / reps / layers * 1e6
    args = [feeds[n] for n in ("q", "k", "v", "slot_mapping", "block_tables", "context_lens", "query_start_loc")]
    t = time.perf_counter()
    for _ in range(reps):
        for k_cache, v_cache in pool:
            paged_attention_cpu(*args, k_cache, v_cache, num_heads=hq, num_kv_heads=hkv, scale=d**-0.5)
    direct_us = (time.perf_counter() - t) / reps / layers * 1e6
    return {"layers": layers, "batch": batch, "context": ctx, "ort_per_node_us": round(ort_us, 1),
            "kernel_direct_us": round(direct_us, 1), "bridge_overhead_us": round(ort_us - direct_us, 1),
            "overhead_per_step_ms": round((ort_us - direct_us) * layers / 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    rows = [measure(args.layers, b, args.context) for b in args.batch]
    cols = list(rows[0])
    print(" ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>20}" for c in cols))
    out = REPO / "benchmarks" / "results" / "bench_ort_bridge.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
