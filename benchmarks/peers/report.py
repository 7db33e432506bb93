#!/usr/bin/env python3
"""Side-by-side report of one run.sh run: llmc vs llama.cpp, ONNX Runtime GenAI and transformers, as ratios.

usage: report.py RUN_DIR --tag small|1b [--out-dir benchmarks/results]
Writes <out-dir>/peers_<tag>.json (every engine's figures, the machine probes, the ratio table and the
bandwidth cross-check) and <out-dir>/peers_<tag>.md, and prints the markdown.

Ratios: llmc / the faster of llama.cpp and ONNX Runtime GenAI at the same precision class (int4 vs q4_0
and int4; fp32 vs f32 and fp32), each figure measured in this one run.

Bandwidth cross-check (issue 9: `llmc bench`'s bandwidth fraction agrees with an independent estimate
within 10%): llmc's fraction = bytes per token from the engine graph x tok/s / read probe (taken by
`llmc bench` right before and after each decode workload). The independent one = bytes per token from
the artifact's weight-file size minus the embedding table (vocab x hidden x the stored width, from
hf_config.json and the recipe) plus the KV from hf_config.json (element width from the manifest), x the
same tok/s / the C AVX-512 read probe (bw_read.c, 2 threads) taken right before and after the llmc run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PEERS = {  # precision class -> (llama.cpp file, ORT GenAI precision)
    "int4": ("llamacpp-q4_0", "ortgenai-int4"),
    "fp32": ("llamacpp-f32", "ortgenai-fp32"),
}
# (model tag, llmc precision, metric, minimum ratio vs the faster peer) from issue 9's "done when".
TARGETS = [
    ("1b", "int4", "decode_b1", 1.05), ("1b", "int4", "decode_b8", 1.5), ("1b", "int4", "prefill_512", 1.0),
    ("1b", "fp32", "decode_b1", 0.95),
    ("small", "int4", "decode_b1", 1.1), ("small", "int4", "decode_b8", 1.5),
]
METRICS = ("decode_b1", "decode_b8", "decode_b32", "prefill_512")
EMBED_BYTES = {"none": None, "int8": 1.0, "int4": 0.5}  # bytes per element of a quantized embedding table


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def peer_metric(res: dict | None, metric: str) -> float | None:
    if not res or res.get("failed"):
        return None
    if metric.startswith("prefill"):
        return res.get("prefill_tps")
    return res.get(f"{metric}_tps")


def llmc_metric(res: dict | None, metric: str) -> float | None:
    if not res or res.get("failed"):
        return None
    row = next((r for r in res["rows"] if r["workload"] == metric), None)
    return row["tok_s"] if row else None


def fmt(x: float | None, nd: int = 1) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def probes_around(probes: list[dict], name: str) -> list[float]:
    return [p["bw_read"]["read_GBps_median"] for p in probes if p["at"] in (f"before {name}", f"after {name}")]


def independent_fraction(engine_dir: Path, res: dict, row: dict, bw: float) -> dict:
    """The bandwidth fraction from the artifact's files and hf_config.json, and the C probe."""
    hf = json.loads((engine_dir / "hf_config.json").read_text())
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    files = sum(p.stat().st_size for p in engine_dir.glob("*.data"))
    hidden, vocab = hf["hidden_size"], hf["vocab_size"]
    head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
    # The build report says whether the embedding table was quantized (only when hidden % group == 0).
    quant = json.loads((engine_dir / "report.json").read_text()).get("quantization") or {}
    emb_fmt = quant.get("embeddings", "none") if (quant.get("graph") or {}).get("embeddings") else "none"
    width = EMBED_BYTES.get(emb_fmt) or {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}[
        manifest["recipe"].get("compute_dtype", "float32")]
    embedding = vocab * hidden * width
    # The cache's element width is the artifact's (manifest kv_cache.dtype: --kv-cache-dtype fp16 halves it).
    kv_width = {"float32": 4, "float16": 2, "bfloat16": 2}[manifest.get("kv_cache", {}).get("dtype", "float32")]
    kv = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * kv_width
    b = row["batch"]
    mean_ctx = row["input_len"] + row["output_len"] / 2
    per_token = (files - embedding) / b + kv * mean_ctx
    achieved = per_token * row["tok_s"] / 1e9
    return {"file_bytes": files, "embedding_bytes_est": int(embedding), "embedding_format": emb_fmt,
            "kv_bytes_per_token": kv, "bytes_per_token": int(per_token), "c_probe_GBps": bw,
            "fraction": achieved / bw}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    ap.add_argument("--engines-dir", type=Path, default=None, help="where convert.sh put the engines")
    args = ap.parse_args()
    run = args.run_dir
    engines_dir = args.engines_dir or run.parent.parent.parent / args.tag
    meta = load(run / "run.json") or {}
    probes = [json.loads(x) for x in (run / "probe.jsonl").read_text().splitlines()] if (
        run / "probe.jsonl").exists() else []
    names = ["llmc-fp32", "llmc-int4", "ortgenai-fp32", "ortgenai-int4", "llamacpp-f32", "llamacpp-q4_0", "hf-fp32"]
    res = {n: load(run / f"{n}.json") or load(run / f"{n}.failed.json") for n in names}

    lines: list[str] = []
    out = lines.append
    loads = [p["loadavg"] for p in probes]
    bws = [p["bw_read"]["read_GBps_median"] for p in probes]
    out(f"# llmc vs peers, model `{args.tag}`, one run ({meta.get('start', '?')} .. {meta.get('end', '?')})\n")
    out(f"{meta.get('cpu', '?')}, {meta.get('nproc', '?')} cores, {meta.get('threads', '?')} threads per engine, "
        f"medians of {meta.get('repeats', '?')} runs after {meta.get('warmup', '?')} warm-up run(s); greedy; "
        "128-token prompts, exactly 128 new tokens; prefill = one 512-token prompt. Engines ran one after another, "
        f"each in its own process. llmc: {meta.get('llmc', '?')}.\n")
    if probes:
        out(f"How busy the machine was: 1/5/15-min load average between engines ranged "
            f"{min(x.split()[0] for x in loads)}–{max(x.split()[0] for x in loads)} (2 cores, shared with other "
            f"work); C read-bandwidth probe (bw_read.c, 2 threads, 1 GiB) {min(bws):.1f}–{max(bws):.1f} GB/s "
            "across the run.\n")

    reruns = [json.loads(x) for x in (run / "reruns.jsonl").read_text().splitlines()] if (
        run / "reruns.jsonl").exists() else []
    for r in reruns:
        out(f"Re-run into this run at {r['start']}: engines matching `{r['rerun']}` (their figures replace the "
            "first ones; the probes of both passes are listed in the JSON).\n")

    # -- the done-when table ---------------------------------------------------------------------
    table = []
    out("## llmc vs the faster peer (ratio > 1: llmc is faster)\n")
    out("| llmc engine | workload | llmc tok/s | llama.cpp tok/s | ORT GenAI tok/s | transformers fp32 tok/s | "
        "faster peer | ratio | issue 9 target | met |")
    out("|---|---|---|---|---|---|---|---|---|---|")
    for prec in ("int4", "fp32"):
        lc, og = PEERS[prec]
        for metric in METRICS:
            mine = llmc_metric(res[f"llmc-{prec}"], metric)
            a, b = peer_metric(res[lc], metric), peer_metric(res[og], metric)
            hf = peer_metric(res["hf-fp32"], metric)
            cands = [(v, n) for v, n in ((a, "llama.cpp"), (b, "ORT GenAI")) if v]
            best, who = max(cands) if cands else (None, None)
            ratio = mine / best if mine and best else None
            target = next((t for tag, p, m, t in TARGETS if tag == args.tag and p == prec and m == metric), None)
            met = "—" if target is None or ratio is None else ("yes" if ratio >= target else "no")
            table.append({"llmc": f"llmc-{prec}", "metric": metric, "llmc_tok_s": mine, "llamacpp_tok_s": a,
                          "ortgenai_tok_s": b, "hf_fp32_tok_s": hf, "faster_peer": who, "ratio": ratio,
                          "target": target, "met": met})
            out(f"| llmc {prec} | {metric} | {fmt(mine)} | {fmt(a)} | {fmt(b)} | {fmt(hf)} | {who or '—'} | "
                f"{fmt(ratio, 2)} | {'≥ ' + str(target) if target else '—'} | {met} |")
    out("")
    # 32 concurrent requests vs ORT GenAI's best batched throughput (same precision).
    out("## 32 concurrent requests: llmc decode b32 vs ONNX Runtime GenAI's best batched decode\n")
    out("| llmc engine | llmc b32 tok/s | ORT GenAI best (b8/b32) tok/s | ratio | target | met |")
    out("|---|---|---|---|---|---|")
    for prec in ("int4", "fp32"):
        og = res[PEERS[prec][1]]
        mine = llmc_metric(res[f"llmc-{prec}"], "decode_b32")
        best = max([v for v in (peer_metric(og, "decode_b8"), peer_metric(og, "decode_b32")) if v], default=None)
        ratio = mine / best if mine and best else None
        met = "—" if ratio is None else ("yes" if ratio >= 2 else "no")
        table.append({"llmc": f"llmc-{prec}", "metric": "b32_vs_ortgenai_best_batched", "llmc_tok_s": mine,
                      "ortgenai_tok_s": best, "ratio": ratio, "target": 2.0, "met": met})
        out(f"| llmc {prec} | {fmt(mine)} | {fmt(best)} | {fmt(ratio, 2)} | ≥ 2 | {met} |")
    out("")

    # -- every engine ----------------------------------------------------------------------------
    out("## Every engine (tok/s)\n")
    out("| engine | weights MB | prefill 512 | decode b1 | decode b8 | decode b32 | C probe GB/s around it |")
    out("|---|---|---|---|---|---|---|")
    for n in names:
        r = res[n]
        bw = probes_around(probes, n)
        bwt = "–".join(f"{x:.1f}" for x in bw) if bw else "—"
        if not r:
            continue
        if r.get("failed"):
            out(f"| {n} | FAILED rc={r.get('rc')} | | | | | {bwt} |")
            continue
        get = llmc_metric if n.startswith("llmc") else peer_metric
        mb = (r["weights"]["files"] if n.startswith("llmc") else r.get("file_bytes", 0)) / 1e6
        out(f"| {n} | {mb:.0f} | {fmt(get(r, 'prefill_512'))} | {fmt(get(r, 'decode_b1'))} | "
            f"{fmt(get(r, 'decode_b8'))} | {fmt(get(r, 'decode_b32'))} | {bwt} |")
    out("")

    # -- bandwidth cross-check -------------------------------------------------------------------
    checks = []
    out("## `llmc bench` bandwidth fraction vs an independent estimate\n")
    out("llmc: graph bytes per token x tok/s / llmc probe (taken by llmc bench around each decode workload). "
        "Independent: (weight-file bytes − embedding table from hf_config) / batch + KV from hf_config, x the "
        "same tok/s / the C probe around the llmc run.\n")
    out("| engine | workload | llmc bytes/token | independent bytes/token | llmc probe GB/s | C probe GB/s | "
        "llmc fraction | independent fraction | agreement |")
    out("|---|---|---|---|---|---|---|---|---|")
    for prec in ("fp32", "int4"):
        name = f"llmc-{prec}"
        r = res[name]
        bw = probes_around(probes, name)
        if not r or r.get("failed") or not bw or not (engines_dir / name).is_dir():
            continue
        c_bw = statistics.mean(bw)
        for row in r["rows"]:
            if not row["workload"].startswith("decode"):
                continue
            ind = independent_fraction(engines_dir / name, r, row, c_bw)
            agree = row["roofline_fraction"] / ind["fraction"]
            checks.append({"engine": name, "workload": row["workload"], "llmc_bytes_per_token": row["bytes_per_token"],
                           "llmc_probe_GBps": row["machine_read_GBps"], "llmc_fraction": row["roofline_fraction"],
                           **{f"independent_{k}": v for k, v in ind.items()}, "agreement": agree,
                           "within_10pct": abs(agree - 1) <= 0.10})
            out(f"| {name} | {row['workload']} | {row['bytes_per_token'] / 1e6:.2f} MB | "
                f"{ind['bytes_per_token'] / 1e6:.2f} MB | {row['machine_read_GBps']:.1f} | {c_bw:.1f} | "
                f"{100 * row['roofline_fraction']:.1f}% | {100 * ind['fraction']:.1f}% | {agree:.3f} |")
    out("")
    # The two probes taken back to back (run.sh's probe(): C first, then llmc bench's llmc probe), so that
    # the comparison is at one instant rather than minutes apart on a machine whose bandwidth drifts.
    pairs = [(p["bw_read"]["read_GBps_median"], p["llmc_probe_GBps"]) for p in probes if p.get("llmc_probe_GBps")]
    if pairs:
        ratios = [n / c for c, n in pairs]
        probe_ratio = statistics.median(ratios)
        out("The same two probes back to back (run.sh, between engines): llmc bench's llmc probe / the C probe = "
            f"{probe_ratio:.3f} (median of {len(pairs)} pairs, range {min(ratios):.3f}–{max(ratios):.3f}; C "
            f"{min(c for c, _ in pairs):.1f}–{max(c for c, _ in pairs):.1f} GB/s).\n")
        out("At one instant, then, llmc bench's fraction / the independent fraction = (llmc bytes / independent "
            "bytes) × (C probe / llmc probe):\n")
        out("| engine | workload | bytes ratio | probe ratio (C / llmc) | agreement at one instant | within 10% |")
        out("|---|---|---|---|---|---|")
        for c in checks:
            bytes_ratio = c["llmc_bytes_per_token"] / c["independent_bytes_per_token"]
            same = bytes_ratio / probe_ratio
            c["agreement_same_instant"] = same
            c["within_10pct_same_instant"] = abs(same - 1) <= 0.10
            out(f"| {c['engine']} | {c['workload']} | {bytes_ratio:.4f} | {1 / probe_ratio:.3f} | {same:.3f} | "
                f"{'yes' if abs(same - 1) <= 0.10 else 'no'} |")
        out("")
    out("Commands: see commands.txt in the run directory and benchmarks/peers/README.md.")
    text = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"peers_{args.tag}.md").write_text(text)
    (args.out_dir / f"peers_{args.tag}.json").write_text(json.dumps(
        {"run": meta, "reruns": reruns, "run_dir": str(run), "probes": probes, "table": table,
         "bandwidth_check": checks, "engines": {n: _slim(r) for n, r in res.items() if r}}, indent=1) + "\n")
    print(text)


def _slim(r: dict) -> dict:
    """An engine's result without per-token ids (kept in the run directory)."""
    return {k: v for k, v in r.items() if not k.startswith("tokens")}


if __name__ == "__main__":
    main()
