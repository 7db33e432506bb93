"""Optimised engine vs the same engine with every fusion disabled: decode and prefill tokens/s.

Both engines are built from one checkpoint and measured in one run, alternating, so the ratio
holds even though this machine's memory bandwidth drifts. Workloads follow ../shared/peers:
decode rate = (N - 1) / (t_N - t_1) over N = 128 new tokens after a 128-token prompt, at batch
1 and 8; prefill rate = prompt tokens / time to first token for one 512-token prompt.

    python benchmarks/bench_fusions.py [--model assets/default-model] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from llmc.compiler.build import BuildOptions, build
from llmc.runtime import Engine, SamplingParams

REPO = Path(__file__).resolve().parent.parent


def decode_rate(engine: Engine, prompts: list[list[int]], n: int) -> float:
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    # All requests run in lockstep: the batch's decode time is from the last first token to the end.
    t_first = max(o.ttft for o in outs)
    t_end = max(o.latency for o in outs)
    return len(prompts) * (n - 1) / (t_end - t_first)


def prefill_rate(engine: Engine, prompt: list[int]) -> float:
    out = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    return len(prompt) / out.ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "assets" / "default-model"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts8 = [rng.integers(4, vocab, 128).tolist() for _ in range(8)]
    long_prompt = rng.integers(4, vocab, 512).tolist()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        nodes = {}
        for label, disabled in (("fused", ()), ("unfused", ("all-fusions",))):
            out = Path(tmp) / label
            r = build(model, out, BuildOptions(disabled_passes=disabled))
            nodes[label] = r.report["graph"]["nodes_final"]
            # No prefix caching: the repeated 512-token prompt would be a cache hit, not a prefill.
            engines[label] = Engine.load(out, num_threads=args.threads, enable_prefix_caching=False)
            engines[label].generate([prompts8[0]], SamplingParams(max_tokens=4))  # warm-up
            results[label] = {"decode_b1": [], "decode_b8": [], "prefill_512": []}
        for _ in range(args.repeats):
            for label, engine in engines.items():
                results[label]["decode_b1"].append(decode_rate(engine, prompts8[:1], 128))
                results[label]["decode_b8"].append(decode_rate(engine, prompts8, 128))
                results[label]["prefill_512"].append(prefill_rate(engine, long_prompt))
    med = {label: {k: statistics.median(v) for k, v in r.items()} for label, r in results.items()}
    rows = []
    print(f"{'workload':14} {'fused tok/s':>12} {'unfused tok/s':>14} {'ratio':>7}")
    for k in ("decode_b1", "decode_b8", "prefill_512"):
        ratio = med["fused"][k] / med["unfused"][k]
        rows.append({"workload": k, "fused_tok_s": round(med["fused"][k], 1),
                     "unfused_tok_s": round(med["unfused"][k], 1), "ratio": round(ratio, 2)})
        print(f"{k:14} {med['fused'][k]:12.1f} {med['unfused'][k]:14.1f} {ratio:7.2f}")
    print(f"graph nodes: fused {nodes['fused']}, unfused {nodes['unfused']}")
    out = REPO / "benchmarks" / "results" / "bench_fusions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model), "threads": args.threads, "nodes": nodes, "rows": rows},
                              indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
