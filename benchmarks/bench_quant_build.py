"""Wall time of quantized builds, end to end (accuracy report included), with the per-stage and per-layer
calibration times each build records, its accuracy figures, and its weights' digest (each calibrated
format built twice: the same seed must give the same bytes).

    python benchmarks/bench_quant_build.py [--model assets/default-model] [--formats int4,int4-awq,int4-gptq]
    python benchmarks/bench_quant_build.py --model ~/.cache/llmc-peers/model-1b      # issue 19's targets

Writes ``benchmarks/results/bench_quant_build_<model>.json`` and prints the table. The targets (issue 19,
1B shape, 2 cores): int4-awq and int4-gptq <= 300 s, int4 <= 90 s. The machine's load average is recorded
with every row: on a shared machine it moves the times more than anything else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from llmc.compiler.build import BuildOptions, build
from llmc.quant.recipe import QuantRecipe

REPO = Path(__file__).resolve().parent.parent
TARGETS_1B = {"int4": 90.0, "int4-awq": 300.0, "int4-gptq": 300.0}
PEERS = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache" / "llmc-peers"))
LLAMA_BIN = PEERS / "llama-build" / "bin"
# The AWQ build may take at most this multiple of llama.cpp's importance matrix + Q4_K_M quantization (issue 19).
LLAMA_CPP_RATIO_TARGET = 1.5


def llama_cpp(model: Path, work: Path, threads: int, samples: int, seq_len: int) -> dict:
    """llama.cpp's calibrated 4-bit path on the same checkpoint: ``llama-imatrix`` over the same calibration text
    (the built-in pydoc training split; ``samples`` chunks of ``seq_len`` tokens, as llmc's default calibration),
    then ``llama-quantize --imatrix`` to Q4_K_M. The float32 GGUF conversion (which llmc's build does not need:
    it reads safetensors) is cached under the peers root and timed apart."""
    from llmc.quant.corpus import pydoc_texts

    gguf = PEERS / "gguf" / f"{model.name}-f32.gguf"
    convert_s = None
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        subprocess.run([str(PEERS / "venv" / "bin" / "python"), str(REPO / "benchmarks" / "peers" / "convert_gguf.py"),
                        str(model), str(gguf), "f32"], check=True, capture_output=True)
        convert_s = round(time.perf_counter() - t, 1)
    text = work / "calib.txt"
    text.write_text("\n\n".join(pydoc_texts("train")))
    t = time.perf_counter()
    subprocess.run([str(LLAMA_BIN / "llama-imatrix"), "-m", str(gguf), "-f", str(text),
                    "-o", str(work / "imatrix.gguf"), "-c", str(seq_len), "-b", str(seq_len),
                    "--chunks", str(samples), "-t", str(threads)],
                   check=True, capture_output=True)
    imatrix_s = time.perf_counter() - t
    t = time.perf_counter()
    out = work / "q4_k_m.gguf"
    subprocess.run([str(LLAMA_BIN / "llama-quantize"), "--imatrix", str(work / "imatrix.gguf"), str(gguf), str(out),
                    "Q4_K_M", str(threads)], check=True, capture_output=True)
    quantize_s = time.perf_counter() - t
    return {"imatrix_s": round(imatrix_s, 1), "quantize_s": round(quantize_s, 1),
            "total_s": round(imatrix_s + quantize_s, 1), "gguf_convert_s": convert_s,
            "q4_k_m_bytes": out.stat().st_size,
            "calibration": f"{samples} x {seq_len} tokens of the pydoc training split", "threads": threads,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def digest(engine: Path) -> str:
    return hashlib.sha256((engine / "model.onnx.data").read_bytes()).hexdigest()


def one(model: Path, out: Path, quant: str, eval_tokens: int | None = None) -> dict:
    t = time.perf_counter()
    result = build(model, out, BuildOptions(quant=QuantRecipe(quant=quant, eval_tokens=eval_tokens)))
    wall = time.perf_counter() - t
    timings = json.loads((out / "build_info.json").read_text())["timings_s"]
    layers = [v for k, v in sorted(timings.items(), key=lambda kv: kv[0]) if k.startswith("quant_calibrate_layer_")]
    return {"build_s": round(wall, 1), "load_avg_1m": round(os.getloadavg()[0], 2),
            "stages_s": {k: v for k, v in timings.items() if not k.startswith("quant_calibrate_layer_")},
            "calibrate_layer_s": layers, "accuracy": result.report.get("accuracy"), "weights_sha256": digest(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "assets" / "default-model")
    ap.add_argument("--formats", default="int4,int4-awq,int4-gptq")
    ap.add_argument("--no-repeat", action="store_true",
                    help="Build each calibrated format once (no determinism check).")
    ap.add_argument("--eval-tokens", type=int, default=None,
                    help="Held-out tokens the accuracy report scores [default: the build's own choice].")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="Also time llama.cpp's llama-imatrix + llama-quantize Q4_K_M on the same checkpoint "
                         "(benchmarks/peers/setup.sh builds them).")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    rows = {}
    peer = None
    with tempfile.TemporaryDirectory(prefix="bench-quant-build-") as tmp:
        # A fresh cache: the first build scores the unquantized reference, later ones reuse it, as a user's would.
        os.environ["LLMC_CACHE_DIR"] = str(Path(tmp) / "cache")
        for quant in args.formats.split(","):
            rows[quant] = one(args.model, Path(tmp) / quant, quant, args.eval_tokens)
            if quant != "int4" and not args.no_repeat:
                again = one(args.model, Path(tmp) / f"{quant}-again", quant, args.eval_tokens)
                rows[quant]["same_seed_identical_weights"] = again["weights_sha256"] == rows[quant]["weights_sha256"]
                rows[quant]["build_s_again"] = again["build_s"]
            print(f"built {quant} in {rows[quant]['build_s']}s (load {rows[quant]['load_avg_1m']})", flush=True)
        if args.llama_cpp:
            recipe = QuantRecipe()
            peer = llama_cpp(args.model, Path(tmp), args.threads, recipe.calib_samples, recipe.calib_seq_len)
            print(f"llama.cpp imatrix + Q4_K_M in {peer['total_s']}s", flush=True)
    print(f"\n{'format':10} | {'build_s':>8} | {'calibrate_s':>11} | {'evaluate_s':>10} | {'ppl':>9} | "
          f"{'kl_mean':>9} | {'tokens':>6} | ref cached | {'load':>5} | same seed, same bytes")
    for quant, r in rows.items():
        acc = r["accuracy"] or {}
        st = r["stages_s"]
        print(f"{quant:10} | {r['build_s']:8.1f} | {st.get('quant_calibrate', 0):11.1f} | "
              f"{st.get('quant_evaluate', 0):10.1f} | {acc.get('ppl', 0):9.4f} | {acc.get('kl_mean', 0):9.6f} | "
              f"{acc.get('tokens', 0):6} | {str(acc.get('reference_cached', '-')):10} | "
              f"{r['load_avg_1m']:5.1f} | {r.get('same_seed_identical_weights', '-')}")
    result = {"model": args.model.name, "cpus": os.cpu_count(), "rows": rows, "targets_1b_s": TARGETS_1B}
    if peer is not None:
        print(f"{'llama.cpp':10} | {peer['total_s']:8.1f} | imatrix {peer['imatrix_s']:.1f} s + quantize "
              f"{peer['quantize_s']:.1f} s (Q4_K_M)")
        result["llama_cpp_imatrix_q4_k_m"] = peer
        if "int4-awq" in rows:
            ratio = rows["int4-awq"]["build_s"] / peer["total_s"]
            result["awq_vs_llama_cpp"] = {"ratio": round(ratio, 2), "target": LLAMA_CPP_RATIO_TARGET}
            print(f"int4-awq build / llama.cpp imatrix + Q4_K_M: {ratio:.2f}x (target <= {LLAMA_CPP_RATIO_TARGET}x)")
    out = REPO / "benchmarks" / "results" / f"bench_quant_build_{args.model.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
