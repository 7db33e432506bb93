#!/usr/bin/env python3
"""A forced tool call's decode speed against unconstrained decoding, at batch 8 (and 1).

B chat requests, rendered with the engine's chat template and a tool (what ``llmc serve`` sends the
engine for ``tool_choice: {"type": "function", ...}``), decode ``--tokens`` tokens each (EOS ignored):
once unconstrained and once under the grammar ``llmc serve`` enforces for that named tool (the hermes
wrapper ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` around the tool's JSON Schema, built by
``serve/tools.constraint``). The tool's arguments hold an array of at least 100 records, so the call
cannot complete within the token budget: both runs decode the same number of tokens at the same batch
size and differ only by the masks. Each round runs the pair back to back (plain first in even rounds,
forced first in odd ones) and the ratio is the median over rounds of forced / plain within a round, so
load drifts on shared cores hit both alike.

usage: bench_tool_calls.py [--engine DIR] [--tokens 128] [--rounds 8] [--out FILE]
(default engine: the bundled default model, built into a temporary directory)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from llmc.runtime import Engine, SamplingParams
from llmc.serve.chat import ChatTemplate
from llmc.serve.tools import constraint, template_messages, validate

REPO = Path(__file__).resolve().parent.parent

RECORDS = {
    "type": "array", "minItems": 100,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "tags"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                             "name": {"type": "string", "maxLength": 16},
                             "kind": {"enum": ["function", "class", "module", "statement"]},
                             "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                      "maxItems": 3}}},
}
TOOL = {"type": "function", "function": {
    "name": "record_objects", "description": "Record Python objects",
    "parameters": {"type": "object", "properties": {"records": RECORDS, "source": {"type": "string"}},
                   "required": ["records"], "additionalProperties": False}}}


def _prompts(engine: Engine, batch: int) -> list[list[int]]:
    template = ChatTemplate.from_engine(engine.path, engine.tokenizer.config)
    spec = validate([TOOL], {"type": "function", "function": {"name": "record_objects"}}, None)
    out = []
    for i in range(batch):
        messages, extra = template_messages([{"role": "user", "content": f"Record the objects of module {i}."}],
                                            spec, template.takes_tools)
        text = template.render(messages, extra=extra)
        out.append(engine.tokenizer.encode(text, add_special_tokens=False))
    return out


def _run(engine: Engine, prompts: list[list[int]], tokens: int, grammar) -> tuple[float, float]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0, structured=grammar)
    engine.reset_prefix_cache()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    if grammar is not None:
        assert all(o.structured_error is None and o.finish_reason == "length" for o in outs), outs[0]
        head = '<tool_call>\n{"name": "record_objects", "arguments": {'
        assert all(o.text.startswith(head) or head.startswith(o.text) for o in outs), outs[0].text
    assert n == len(prompts) * tokens
    return n / dt, n / dc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, help="engine directory")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (default: all cores)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_tool_calls.json")
    args = ap.parse_args()
    tmp = None
    path = args.engine
    if path is None:
        from llmc.compiler.build import BuildOptions, build

        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "default-model"
        build(REPO / "assets" / "default-model", path, BuildOptions())
    engine = Engine.load(path, num_threads=args.threads)
    spec = validate([TOOL], {"type": "function", "function": {"name": "record_objects"}}, None)
    grammar = constraint(spec, "hermes", {})
    rows = []
    for batch in (8, 1):
        prompts = _prompts(engine, batch)
        _run(engine, prompts, 16, None)  # warm both paths (and compile the grammar once)
        _run(engine, prompts, 16, grammar)
        rt = engine.structured
        m0, s0 = rt.masks, rt.mask_seconds
        plain, forced = [], []
        for r in range(args.rounds):  # pairs in alternating order, so neither run always goes first
            if r % 2 == 0:
                plain.append(_run(engine, prompts, args.tokens, None))
                forced.append(_run(engine, prompts, args.tokens, grammar))
            else:
                forced.append(_run(engine, prompts, args.tokens, grammar))
                plain.append(_run(engine, prompts, args.tokens, None))
        rows.append({"batch": batch, "tokens": args.tokens, "rounds": args.rounds,
                     "prompt_tokens": len(prompts[0]),
                     "plain_tok_s": statistics.median(p[0] for p in plain),
                     "forced_call_tok_s": statistics.median(f[0] for f in forced),
                     "ratio": statistics.median(f[0] / p[0] for f, p in zip(forced, plain, strict=True)),
                     "cpu_ratio": statistics.median(f[1] / p[1] for f, p in zip(forced, plain, strict=True)),
                     "ratios": [f[0] / p[0] for f, p in zip(forced, plain, strict=True)],
                     "mask_us_per_token": (rt.mask_seconds - s0) / max(1, rt.masks - m0) * 1e6})
    print(f"{'batch':>6}{'plain tok/s':>13}{'forced tok/s':>14}{'ratio':>7}{'cpu ratio':>10}{'mask us/tok':>13}")
    for r in rows:
        print(f"{r['batch']:>6}{r['plain_tok_s']:>13.1f}{r['forced_call_tok_s']:>14.1f}{r['ratio']:>7.2f}"
              f"{r['cpu_ratio']:>10.2f}{r['mask_us_per_token']:>13.1f}")
    meta = {"engine": "assets/default-model (cpu, fp32 build)" if args.engine is None else str(args.engine),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
            "load_average_at_end": os.getloadavg(),
            "grammar": "serve/tools.constraint: hermes wrapper around the tool's schema (named tool_choice)",
            "ratios": "median over rounds of forced / unconstrained run back to back (order alternating per round); "
                      "on cores shared with other processes the wall-clock ratio also measures CPU share: a forced "
                      "run's mask workers are more runnable threads, which win it a larger share of contended "
                      "cores, so compare cpu_ratio (tokens per CPU second of this process) there"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "tool": TOOL, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
