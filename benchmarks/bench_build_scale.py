#!/usr/bin/env python3
"""Quantized builds at the sizes users deploy, on this machine: build time and peak resident memory per stage.

Builds random-weight Llama shapes (bf16 checkpoints from ``benchmarks/peers/make_model.py``, made when missing) with
each recipe, each in its own ``llmc build`` process, and records:

- ``peak_gb``: the build process's peak resident memory, the largest of the per-stage peaks llmc writes to
  ``build_info.json`` (the kernel's high-water mark, reset per stage; ``/usr/bin/time`` reports only the last
  stage's once it has been reset);
- ``tree_peak_gb``: the largest sum of resident memory over the build's process tree (with the self-check's
  worker), sampled every 0.2 s from outside;
- ``bound_gb``: the issue's bound, 4 GB plus twice the largest layer in float32 (from the safetensors headers);
- wall time, and llmc's own stage timings.

Results go to ``benchmarks/results/bench_build_scale.json`` after every build (a long run keeps what it finished).

    python benchmarks/bench_build_scale.py                       # 1b 3b 8b x every recipe (hours here)
    python benchmarks/bench_build_scale.py --shapes 1b --recipes cpu:int4,h100:fp8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("cpu:int4", "cpu:int4-awq", "cpu:fp8", "h100:fp8", "h100:int4-awq")
GB = 1 << 30


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def largest_layer_fp32(ckpt: Path) -> tuple[str, int]:
    """The largest decoder layer (or layer-less tensor) of the checkpoint, and its size in float32 bytes (the
    build's own memory plan, compiler/memory_plan.py)."""
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.compiler.memory_plan import estimate
    from llmc.quant.recipe import QuantRecipe

    c = load_checkpoint(ckpt)
    est = estimate(c.tensors, c.config, QuantRecipe())
    return est.largest, est.largest_bytes


def checkpoint(shape: str, root: Path) -> Path:
    path = root / f"model-{shape}-bf16"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks/peers/make_model.py"), shape, "--dtype", "bfloat16",
                        "--out", str(path)], check=True, env={**os.environ, "PEERS_ROOT": str(root)})
    return path


def run_build(ckpt: Path, recipe: str, cache: Path, timeout: float, extra: list[str]) -> dict:
    target, quant = recipe.split(":")
    with tempfile.TemporaryDirectory(prefix="llmc-scale-") as tmp:
        out = Path(tmp) / "engine"
        cmd = [str(Path(sys.executable).with_name("llmc")), "build", str(ckpt), "-o", str(out), "--quant", quant,
               "--cache-dir", str(cache), "--no-cache", "--json", *extra,
               *(["--target", "cpu"] if target == "cpu" else ["--gpu", target])]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tree_peak = 0
        while proc.poll() is None:
            tree_peak = max(tree_peak, _tree_rss(proc.pid))
            if time.perf_counter() - t0 > timeout:
                proc.kill()
            time.sleep(0.2)
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - t0
        row = {"recipe": recipe, "rc": proc.returncode, "wall_s": round(wall, 1),
               "tree_peak_gb": round(tree_peak / GB, 3)}
        if proc.returncode != 0:
            row["error"] = (stderr.strip().splitlines() or ["(no output)"])[-1][-400:]
            return row
        info = json.loads((out / "build_info.json").read_text())
        peaks = info.get("memory", {}).get("peak_rss_gb", {})
        row.update(peak_gb=max(peaks.values()) if peaks else None, stage_peaks_gb=peaks,
                   timings_s={k: v for k, v in info["timings_s"].items() if not k.startswith("quant_calibrate_")},
                   accuracy=json.loads(stdout).get("accuracy"))
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,3b,8b")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="TARGET:QUANT, comma-separated")
    ap.add_argument("--root", type=Path, default=Path(os.environ.get("PEERS_ROOT",
                                                                      Path.home() / ".cache/llmc-peers")))
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per build")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_build_scale.json")
    ap.add_argument("--extra", default="", help="more llmc build flags, space-separated")
    args = ap.parse_args()
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"builds": []}
    results.update(machine={"cpus": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PHYS_PAGES")
                                                                        * os.sysconf("SC_PAGE_SIZE") / GB, 1)},
                   command=" ".join(sys.argv))
    # The builds' cache (the artifacts of --no-cache builds: 6.8 GB after one 8B fp8 build), removed at the end.
    cache = Path(tempfile.mkdtemp(prefix="llmc-scale-cache-"))
    try:
        _sweep(args, results, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print("\n" + table(results["builds"]))


def _sweep(args: argparse.Namespace, results: dict, cache: Path) -> None:
    for shape in args.shapes.split(","):
        ckpt = checkpoint(shape, args.root)
        layer, size = largest_layer_fp32(ckpt)
        for recipe in args.recipes.split(","):
            print(f"{shape} {recipe} ...", flush=True)
            row = {"shape": shape, "largest_layer": layer, "largest_layer_fp32_gb": round(size / GB, 3),
                   "bound_gb": round(4 + 2 * size / GB, 3),
                   **run_build(ckpt, recipe, cache, args.timeout, args.extra.split())}
            row["within_bound"] = row.get("peak_gb") is not None and max(row["peak_gb"], 0) <= row["bound_gb"]
            results["builds"] = [b for b in results["builds"] if (b["shape"], b["recipe"]) != (shape, recipe)]
            results["builds"].append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")
            print(_row(row), flush=True)


def _row(b: dict) -> str:
    t = b.get("timings_s", {})
    peaks = b.get("stage_peaks_gb", {})
    stages = " ".join(f"{k} {v:.2f}" for k, v in peaks.items())
    return (f"| {b['shape']} | {b['recipe']} | {b['rc']} | {b['wall_s']:.0f} | {t.get('quant_calibrate', 0):.0f} | "
            f"{t.get('quant_evaluate', 0):.0f} | {b.get('peak_gb') or 0:.2f} | {b['tree_peak_gb']:.2f} | "
            f"{b['bound_gb']:.2f} | {'yes' if b.get('within_bound') else 'NO'} | {stages or b.get('error', '')} |")


def table(builds: list[dict]) -> str:
    head = ("| shape | recipe | rc | wall s | calibrate s | evaluate s | peak GB | tree peak GB | bound GB | within | "
            "per-stage peak GB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([head, *(_row(b) for b in builds)])


if __name__ == "__main__":
    main()
