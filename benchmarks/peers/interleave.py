#!/usr/bin/env python3
"""Decode batch 1 with llmc and its peers in alternation, every engine loaded at once, so each ratio compares
runs made seconds apart instead of minutes.

Why: this machine's read bandwidth drifts between about 35 and 78 GB/s from minute to minute, and a decode
at the bandwidth limit (the 1B shape in fp32) moves with it one for one. run.sh measures one engine after
another, minutes apart, so a round's ratio is mostly which engine drew the fast state (run.sh rounds of the
1B fp32 engines: 0.70 to 1.24). Here every engine is loaded in its own worker process first (the `--serve`
mode of the bench scripts); then each round runs one 128-token decode on each engine, in an order that
rotates from round to round, with the C read-bandwidth probe at the start of every round.

usage: interleave.py TAG PRECISION [--rounds 8] [--out-dir benchmarks/results]
       TAG: small | 1b; PRECISION: fp32 | int4 (llmc-P against llamacpp-{f32|q4_0} and ortgenai-P)
env:   PEERS_ROOT, BENCH_THREADS (2), LLMC_PYTHON (the Python that has llmc), as for run.sh
Writes <out-dir>/peers_<tag>_<precision>_interleaved.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_common as bc  # noqa: E402  (stdlib only: runs under any Python)

ROOT = Path(bc.ROOT)
GGUF = {"fp32": "f32", "int4": "q4_0"}
SETTLE_S = 1.0  # ORT's workers spin a little after a run; let them sleep before the next engine starts


def commands(tag: str, precision: str) -> dict[str, list[str]]:
    peers_py = str(ROOT / "venv" / "bin" / "python")
    llmc_py = os.environ.get("LLMC_PYTHON", sys.executable)
    o = ROOT / tag
    t = GGUF[precision]
    return {
        f"llmc-{precision}": [llmc_py, str(HERE / "bench_llmc_serve.py"), str(o / f"llmc-{precision}")],
        f"ortgenai-{precision}": [peers_py, str(HERE / "bench_ortgenai.py"), "--model",
                                  str(o / f"ortgenai-{precision}"), "--precision", precision, "--out", "/dev/null",
                                  "--serve"],
        f"llamacpp-{t}": [peers_py, str(HERE / "bench_llamacpp.py"), "--model", str(o / "gguf" / f"model-{t}.gguf"),
                          "--precision", t, "--out", "/dev/null", "--serve"],
    }


class Worker:
    """One engine in its own process, answering ``run`` with a JSON line (bench_common.serve)."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.log = log.open("w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)
        self.ready = self._reply()

    def _reply(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                msg = json.loads(line[2:])
                if "error" in msg:
                    raise RuntimeError(f"{self.name}: {msg['error']}")
                return msg
        raise RuntimeError(f"{self.name} exited (rc {self.proc.wait()}); see {self.log.name}")

    def run(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.log.close()


def probe_GBps() -> float | None:
    """Median of the C AVX-512 read probe (2 threads, 1 GiB), GB/s."""
    exe = ROOT / "bw_read"
    if not exe.exists():
        return None
    out = subprocess.run([str(exe), "10"], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(bc.THREADS))).stdout
    try:
        return float(json.loads(out)["read_GBps_median"])
    except (ValueError, KeyError):
        return None


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def llmc_revision() -> str:
    out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", choices=["small", "1b"])
    ap.add_argument("precision", choices=["fp32", "int4"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out-dir", type=Path, default=HERE.parent / "results")
    args = ap.parse_args()
    cmds = commands(args.tag, args.precision)
    logs = ROOT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    names = list(cmds)
    llmc, peers = names[0], names[1:]
    workers: dict[str, Worker] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        for name in names:  # one at a time: loading competes for the same two cores
            print(f"loading {name}", file=sys.stderr, flush=True)
            workers[name] = Worker(name, cmds[name], logs / f"interleave_{args.tag}_{name}.err")
        rounds = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            row = {"round": r + 1, "order": order, "probe_GBps": probe_GBps(), "runs": {}}
            for name in order:
                time.sleep(SETTLE_S)
                row["runs"][name] = workers[name].run()
            tps = {n: row["runs"][n]["decode_tps"] for n in names}
            best = max(peers, key=lambda n: tps[n])
            row["ratio"] = tps[llmc] / tps[best]
            row["faster_peer"] = best
            rounds.append(row)
            print(f"round {r + 1}: " + " / ".join(f"{n} {tps[n]:.1f}" for n in names)
                  + f"  ratio {row['ratio']:.3f}  probe {row['probe_GBps']}", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    ratios = [r["ratio"] for r in rounds]
    med = {n: statistics.median(r["runs"][n]["decode_tps"] for r in rounds) for n in names}
    summary = {
        "tag": args.tag, "precision": args.precision, "threads": bc.THREADS,
        "cpu": cpu_model(), "cpus": os.cpu_count(), "llmc": llmc_revision(),
        "started": started, "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "engines": names,
        "commands": cmds, "ready": {n: w.ready for n, w in workers.items()},
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
        "median_tps": med, "ratio_of_medians": med[llmc] / max(med[p] for p in peers), "rounds": rounds,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"peers_{args.tag}_{args.precision}_interleaved"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# {args.tag} {args.precision} decode b1, engines interleaved ({len(rounds)} rounds)", "",
             f"`benchmarks/peers/interleave.py {args.tag} {args.precision} --rounds {args.rounds}`, {started} .. "
             f"{summary['ended']}, llmc at {summary['llmc']}, {summary['cpu']} ({summary['cpus']} CPUs, "
             f"{summary['threads']} threads per engine): every engine loaded at once, one 128-token greedy decode of "
             "the same 128-token prompt per engine per round, order rotating; C probe = bw_read median at the "
             "round's start.", "",
             "| round | " + " | ".join(f"{n} tok/s" for n in names) + " | llmc / faster peer | C probe GB/s |",
             "|---|" + "---|" * (len(names) + 2)]
    for r in rounds:
        lines.append(f"| {r['round']} | " + " | ".join(f"{r['runs'][n]['decode_tps']:.2f}" for n in names)
                     + f" | {r['ratio']:.3f} | {r['probe_GBps']} |")
    lines += ["", f"Median of the per-round ratios: **{summary['median_ratio']:.3f}** (range "
              f"{summary['min_ratio']:.3f}-{summary['max_ratio']:.3f}); ratio of the median rates: "
              f"{summary['ratio_of_medians']:.3f}.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
