#!/usr/bin/env python3
"""The streamed (layer-by-layer) accuracy report against whole-engine scoring, on a real checkpoint.

Builds CKPT twice (unquantized, and with ``--quant``), reads the quantized build's report (scored layer by layer),
then scores the same held-out windows with both engines loaded whole (``Engine.score``, the report's method before
it streamed) through the same ``compare()``, and prints both sets of figures and their relative differences
(the issue's bar: perplexity and KL within 1e-5 relative, the same stopping point). Loading the whole unquantized
engine needs the model's float32 size in memory: this check is what the build no longer has to do.

    python benchmarks/bench_streamed_report.py --checkpoint ~/.cache/llmc-peers/model-1b-bf16 --quant int4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "assets/default-model")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_streamed_report.json")
    args = ap.parse_args()

    from llmc.compiler.build import BuildOptions, build
    from llmc.quant import evaluate
    from llmc.quant.recipe import QuantRecipe
    from llmc.runtime import Engine

    with tempfile.TemporaryDirectory(prefix="llmc-streamed-") as tmp:
        t = time.perf_counter()
        quantized = build(args.checkpoint, Path(tmp) / "q", BuildOptions(quant=QuantRecipe(quant=args.quant)))
        build_s = time.perf_counter() - t
        streamed = quantized.report["accuracy"]
        build(args.checkpoint, Path(tmp) / "ref", BuildOptions())
        reference = Engine.load(Path(tmp) / "ref", kv_cache_tokens=512)
        engine = Engine.load(Path(tmp) / "q", kv_cache_tokens=512)
        windows = evaluate.heldout_windows(Path(tmp) / "q" / "tokenizer.json", 256, 65536)
        t = time.perf_counter()
        whole = evaluate.compare(lambda i, ids: evaluate.log_softmax(reference.score(ids)),
                                 lambda i, ids: engine.score(ids), windows, precision=evaluate.Precision())
        whole_s = time.perf_counter() - t
    rows = {}
    for key in ("ppl_reference", "ppl", "ppl_increase_pct", "kl_mean", "top1_agreement", "tokens", "windows",
                "stopped"):
        a, b = streamed[key], getattr(whole, key)
        rel = abs(a - b) / abs(b) if isinstance(b, float) and b else (0.0 if a == b else None)
        rows[key] = {"streamed": a, "whole": b, "rel_diff": rel}
        print(f"{key:18s} streamed {a!s:>14}  whole {b!s:>14}  rel diff {rel}")
    result = {"checkpoint": str(args.checkpoint), "quant": args.quant, "figures": rows,
              "build_s": round(build_s, 1), "whole_engine_scoring_s": round(whole_s, 1),
              "build_peak_rss_gb": quantized.build_info.get("memory", {}).get("peak_rss_gb")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
