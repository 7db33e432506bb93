#!/usr/bin/env python3
"""Structured outputs: mask cost per token and decode tok/s with and without a JSON Schema.

For each engine and batch size (1, 8): B requests decode ``--tokens`` tokens each (EOS ignored), once
unconstrained and once under a JSON Schema whose structure cannot complete within that many tokens (an
array of at least 100 records), so both runs decode the same number of tokens at the same batch size and
differ only by the masks. Constrained runs twice: masks computed while the forward pass runs (the
default, ``overlap``) and in the step thread before it (``overlap=False``, printed ``inline``), which
shows what the overlap buys.
``mask us/token`` is the mean time of one mask computation (llguidance, in the workers).

``--llamacpp F.gguf`` adds llama.cpp beside it: the same model as GGUF, batch 1, same schema (as GBNF,
llama-cpp-python's converter), prompt and token count, greedy, through
benchmarks/peers/bench_llamacpp_structured.py run by ``--llamacpp-python`` (the peers venv of
benchmarks/peers/setup.sh, which has llama-cpp-python). The default model's GGUF:
``LLAMA_CPP_SRC=~/.cache/llmc-peers/sdist/llama_cpp_python-*/vendor/llama.cpp
~/.cache/llmc-peers/venv/bin/python benchmarks/peers/convert_gguf.py assets/default-model default-f32.gguf f32``

usage: bench_structured.py [--engine DIR ...] [--tokens 128] [--rounds 3] [--out FILE] [--llamacpp F.gguf]
(default engine: the bundled default model, built into a temporary directory)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmc.runtime import Engine, SamplingParams
from llmc.runtime.sampling.structured import StructuredConfig

REPO = Path(__file__).resolve().parent.parent

SCHEMA = {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                             "name": {"type": "string", "maxLength": 16},
                             "kind": {"enum": ["function", "class", "module", "statement"]},
                             "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                      "maxItems": 3}}},
}
PROMPT = "A list of Python objects as JSON records:"


def _run(engine: Engine, batch: int, tokens: int, structured: bool) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process: all its threads, mask workers too)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, structured={"json": SCHEMA} if structured else None)
    engine.reset_prefix_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate([f"{PROMPT} {i}" for i in range(batch)], params)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    if structured:
        assert all(o.structured_error is None and o.finish_reason == "length" for o in outs), outs[0]
        assert n == batch * tokens
    return n / dt, n / dc


def bench_engine(path: Path, tokens: int, rounds: int) -> list[dict]:
    rows = []
    for overlap in (True, False):
        engine = Engine.load(path, structured_config=StructuredConfig(overlap=overlap))
        for batch in (1, 8):
            _run(engine, batch, 16, False)  # warm both paths (and compile the schema once)
            _run(engine, batch, 16, True)
            plain, cons = [], []
            rt = engine.structured
            m0, s0 = rt.masks, rt.mask_seconds
            for _ in range(rounds):  # interleaved, so load drifts hit both alike
                plain.append(_run(engine, batch, tokens, False))
                cons.append(_run(engine, batch, tokens, True))
            mask_us = (rt.mask_seconds - s0) / max(1, rt.masks - m0) * 1e6
            rows.append({"engine": path.name if path.name != "engine" else path.parent.name,
                         "batch": batch, "overlap": overlap, "tokens": tokens, "rounds": rounds,
                         "plain_tok_s": statistics.median(p[0] for p in plain),
                         "json_schema_tok_s": statistics.median(c[0] for c in cons),
                         # per round, constrained over the unconstrained run just before it (load drifts cancel)
                         "ratio": statistics.median(c[0] / p[0] for c, p in zip(cons, plain, strict=True)),
                         # the same per CPU second of the process: what the constraint costs in work, which
                         # other processes on shared cores disturb less than wall time
                         "cpu_ratio": statistics.median(c[1] / p[1] for c, p in zip(cons, plain, strict=True)),
                         "ratios": [c[0] / p[0] for c, p in zip(cons, plain, strict=True)],
                         "mask_us_per_token": mask_us})
    return rows


def bench_llamacpp(gguf: Path, python: Path, tokens: int, rounds: int, name: str) -> dict:
    """llama.cpp's batch-1 row (same schema, prompt, tokens), from the peers venv's llama-cpp-python."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(SCHEMA, f)
    try:
        proc = subprocess.run([str(python), str(REPO / "benchmarks" / "peers" / "bench_llamacpp_structured.py"),
                               "--model", str(gguf), "--schema", f.name, "--prompt", f"{PROMPT} 0",
                               "--tokens", str(tokens), "--rounds", str(rounds)],
                              capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        sys.exit(f"llama.cpp run failed: {last}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, cons = got["plain"], got["json_schema"]
    return {"engine": name, "batch": 1, "overlap": None, "tokens": tokens, "rounds": rounds,
            "plain_tok_s": statistics.median(plain), "json_schema_tok_s": statistics.median(cons),
            "ratio": statistics.median(c / p for c, p in zip(cons, plain, strict=True)),
            "cpu_ratio": None, "ratios": [c / p for c, p in zip(cons, plain, strict=True)],
            "mask_us_per_token": None, "masks": "gbnf", "threads": got["threads"],
            "llama_cpp_python": got["llama_cpp_python"], "sample": got["sample"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", type=Path, help="engine directory (repeatable)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_structured.json")
    ap.add_argument("--llamacpp", type=Path, help="GGUF of the same model: add llama.cpp's batch-1 row")
    ap.add_argument("--llamacpp-python", type=Path,
                    default=Path.home() / ".cache" / "llmc-peers" / "venv" / "bin" / "python",
                    help="a python with llama-cpp-python (default: the peers venv)")
    args = ap.parse_args()
    engines = args.engine
    tmp = None
    if not engines:
        from llmc.compiler.build import BuildOptions, build

        tmp = tempfile.TemporaryDirectory()
        target = Path(tmp.name) / "default-model"
        build(REPO / "assets" / "default-model", target, BuildOptions())
        engines = [target]
    rows = []
    for e in engines:
        rows += bench_engine(e, args.tokens, args.rounds)
    if args.llamacpp is not None:
        rows.append(bench_llamacpp(args.llamacpp, args.llamacpp_python, args.tokens, args.rounds,
                                   f"llama.cpp {args.llamacpp.stem}"))
    print(f"{'engine':<16}{'batch':>6}{'masks':>10}{'plain tok/s':>13}{'schema tok/s':>14}{'ratio':>7}"
          f"{'cpu ratio':>10}{'mask us/tok':>13}")
    for r in rows:
        masks = r.get("masks") or ("overlap" if r["overlap"] else "inline")
        mask_us = f"{r['mask_us_per_token']:>13.1f}" if r["mask_us_per_token"] is not None else f"{'-':>13}"
        cpu = f"{r['cpu_ratio']:>10.2f}" if r.get("cpu_ratio") is not None else f"{'-':>10}"
        print(f"{r['engine']:<16}{r['batch']:>6}{masks:>10}{r['plain_tok_s']:>13.1f}"
              f"{r['json_schema_tok_s']:>14.1f}{r['ratio']:>7.2f}{cpu}{mask_us}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "llamacpp": (f"{args.llamacpp}: batch 1 only; its schema grammar (llama-cpp-python's converter) allows "
                         "whitespace between JSON tokens, llmc's default does not, so the two decode different "
                         "token sequences of the same language" if args.llamacpp is not None
                         else "not run (no --llamacpp GGUF)"),
            "ratios": "median over rounds of constrained / the unconstrained run just before it; shared cores "
                      "make single rounds swing 0.6-2x (see each row's ratios)"}
    args.out.write_text(json.dumps({"meta": meta, "schema": SCHEMA, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
