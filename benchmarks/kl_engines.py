#!/usr/bin/env python3
"""How far one engine's next-token distributions are from another's (the same checkpoint built two ways).

Scores `--prompts` random prompts of `--len` tokens (seeded) with both engines and prints the mean and largest
KL(A || B) over every position, in nats, and the share of positions where the two argmaxes agree. Used for the
opt-in `--mxfp4-activations int8` against the exact build, and for the bfloat16-weight lowering against float32
weights.

    python benchmarks/kl_engines.py ENGINE_A ENGINE_B [--prompts 3] [--len 96] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from llmc.runtime import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--len", type=int, default=96)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    a, b = Engine.load(args.a), Engine.load(args.b)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, a.vocab_size, args.len).tolist() for _ in range(args.prompts)]
    kls, same = [], []
    for p in prompts:
        x, y = a.score(p), b.score(p)
        lx = x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
        ly = y - np.logaddexp.reduce(y, axis=-1, keepdims=True)
        kls.extend((np.exp(lx) * (lx - ly)).sum(-1))
        same.extend(x.argmax(-1) == y.argmax(-1))
    result = {"a": str(args.a), "b": str(args.b), "positions": len(kls), "kl_mean": float(np.mean(kls)),
              "kl_max": float(np.max(kls)), "top1_agreement": float(np.mean(same))}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
