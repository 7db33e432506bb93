"""INT4 matmul kernels side by side: llmc's Int4MatMul against ONNX Runtime's MatMulNBits (level 4).

Each kernel runs a graph of the 1B shape's MLP weights (hidden 2048, intermediate 8192: up/gate as one
2048 -> 16384 matmul, then 8192 -> 2048, repeated ``--layers`` times, ~0.4 GB of int4 weights at
the default 8 layers, far beyond the last-level cache, as in a real decode step) and one of the 110M
shape's (576 -> 3072, 1536 -> 576, 30 layers). Both kernels get the same g128 weights with zero
points, the same inputs, the same ONNX Runtime session options (``--threads`` intra-op threads,
passive waiting); rounds alternate between them so the machine's drift hits both alike. Figures:
milliseconds per graph run (median of ``--repeats`` rounds), the weight bytes read per second, and
llmc / MLAS speedup. Rows: batch (M) 1, 8, 32, 128 by default.

    python benchmarks/bench_int4_matmul.py [--batches 1 8 32 128] [--threads 2] [--repeats 5] [--layers 8]

Prints a table and writes benchmarks/results/bench_int4_matmul.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def build_graphs(shape: str, layers: int, seed: int = 0) -> tuple[bytes, bytes, int, int]:
    """(llmc graph, MatMulNBits graph, input width, int4 weight bytes) for ``layers`` MLP blocks."""
    from onnx import TensorProto, helper, numpy_helper

    from llmc.plugins.int4_matmul import pack
    from llmc.quant import int4

    hidden, inter = (2048, 8192) if shape == "1b" else (576, 1536)
    rng = np.random.default_rng(seed)
    ours, theirs, inits_a, inits_b = [], [], [], []
    x, weight_bytes = "X", 0
    for i in range(layers):
        for j, (k, n) in enumerate([(hidden, 2 * inter), (inter, hidden)]):
            name = f"l{i}_{j}"
            q = int4.quantize_rtn((rng.standard_normal((n, k)) * 0.02).astype(np.float32), 128, False)
            t = pack.pack(q.q, q.scales, q.zero_points, q.group_size, q.k)
            weight_bytes += t.w.nbytes + t.scales.nbytes + t.mins.nbytes
            inits_a += [numpy_helper.from_array(t.w, f"{name}_w"), numpy_helper.from_array(t.scales, f"{name}_s"),
                        numpy_helper.from_array(t.mins, f"{name}_m")]
            inits_b += [numpy_helper.from_array(q.matmulnbits_b(), f"{name}_w"),
                        numpy_helper.from_array(q.scales, f"{name}_s"),
                        numpy_helper.from_array(q.matmulnbits_zero_points(), f"{name}_z")]
            out = f"{name}_y"
            ours.append(helper.make_node("Int4MatMul", [x, f"{name}_w", f"{name}_s", f"{name}_m"], [out],
                                         domain="llmc", K=k, N=n, group_size=128))
            theirs.append(helper.make_node("MatMulNBits", [x, f"{name}_w", f"{name}_s", f"{name}_z"], [out],
                                           domain="com.microsoft", K=k, N=n, bits=4, block_size=128,
                                           accuracy_level=4))
            if j == 0:  # keep the first half (the "gate") as the next input, as SwiGLU halves the width
                for nodes in (ours, theirs):
                    nodes.append(helper.make_node("Slice", [out, "s0", "s1", "ax"], [f"{name}_h"]))
                x = f"{name}_h"
            else:
                x = out
    consts = [numpy_helper.from_array(np.array([0], np.int64), "s0"),
              numpy_helper.from_array(np.array([inter], np.int64), "s1"),
              numpy_helper.from_array(np.array([-1], np.int64), "ax")]
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("llmc", 1), helper.make_opsetid("com.microsoft", 1)]
    models = []
    for nodes, inits in ((ours, inits_a), (theirs, inits_b)):
        g = helper.make_graph(nodes, shape, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", hidden])], inits + consts)
        models.append(helper.make_model(g, opset_imports=opsets).SerializeToString())
    return models[0], models[1], hidden, weight_bytes


def session(model: bytes, threads: int):
    import onnxruntime as ort

    from llmc.plugins.paged_attention import ort_native

    so = ort.SessionOptions()
    so.register_custom_ops_library(ort_native.library_path())
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--shapes", nargs="+", default=["1b", "110m"], choices=["1b", "110m"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=8, help="MLP blocks of the 1B shape (the 110M shape has 30)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_int4_matmul.json"))
    args = p.parse_args()
    from llmc.plugins.paged_attention import ort_native

    rows = []
    for shape in args.shapes:
        a, b, hidden, nbytes = build_graphs(shape, args.layers if shape == "1b" else 30)
        sessions = {"llmc": session(a, args.threads), "mlas": session(b, args.threads)}
        for m in args.batches:
            x = np.random.default_rng(m).standard_normal((m, hidden)).astype(np.float32)
            outs = {k: s.run(None, {"X": x})[0] for k, s in sessions.items()}  # warm-up, and the agreement
            diff = float(np.abs(outs["llmc"] - outs["mlas"]).max() / np.abs(outs["mlas"]).max())
            reps = max(1, int(0.3 / max(1e-4, _once(sessions["mlas"], x))))
            times = {k: [] for k in sessions}
            for _ in range(args.repeats):
                for k, s in sessions.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        s.run(None, {"X": x})
                    times[k].append((time.perf_counter() - t) / reps)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            row = {"shape": shape, "batch": m, "weight_MB": round(nbytes / 1e6, 1),
                   "llmc_ms": round(ms["llmc"], 3), "mlas_ms": round(ms["mlas"], 3),
                   "llmc_GBps": round(nbytes / ms["llmc"] / 1e6, 1), "mlas_GBps": round(nbytes / ms["mlas"] / 1e6, 1),
                   "speedup": round(ms["mlas"] / ms["llmc"], 3), "max_rel_diff": float(f"{diff:.2e}"),
                   "llmc_rounds_ms": [round(t * 1e3, 3) for t in times["llmc"]],
                   "mlas_rounds_ms": [round(t * 1e3, 3) for t in times["mlas"]]}
            rows.append(row)
            print(f"{shape:5} M={m:<4} llmc {row['llmc_ms']:9.3f} ms ({row['llmc_GBps']:5.1f} GB/s)  "
                  f"mlas {row['mlas_ms']:9.3f} ms ({row['mlas_GBps']:5.1f} GB/s)  x{row['speedup']}  "
                  f"diff {diff:.1e}", flush=True)
    print("\n| shape | batch | weights MB | llmc ms | MLAS ms | llmc GB/s | MLAS GB/s | llmc speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['weight_MB']} | {r['llmc_ms']} | {r['mlas_ms']} | "
              f"{r['llmc_GBps']} | {r['mlas_GBps']} | {r['speedup']} |")
    lib = ort_native.load()
    meta = {"threads": args.threads, "repeats": args.repeats, "layers_1b": args.layers,
            "isa": {0: "scalar", 1: "avx2", 2: "avx512-vnni"}[lib.llmc_int4_get_isa()],
            "machine": platform.processor() or platform.machine(), "loadavg_start": os.getloadavg()}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


def _once(sess, x) -> float:
    t = time.perf_counter()
    sess.run(None, {"X": x})
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
