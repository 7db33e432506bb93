#!/usr/bin/env python3
"""llama.cpp's structured outputs beside llmc's: decode tok/s at batch 1 with and without a JSON Schema.

Runs under the peers venv (llama-cpp-python; benchmarks/peers/setup.sh), called by
benchmarks/bench_structured.py with the same schema, prompt and token count as its llmc rows. The schema
becomes a GBNF grammar with llama-cpp-python's own converter (``LlamaGrammar.from_json_schema``, what its
``response_format={"type": "json_object", "schema": ...}`` uses; it allows whitespace between JSON tokens,
llmc's default does not). Generation is greedy through ``Llama.generate(temp=0)`` (llama.cpp's sampler
chain: the grammar sampler, then greedy; no Python logits processor, no detokenizing) for exactly
``--tokens`` tokens, going on past an EOS like llmc's ``ignore_eos`` (the schema cannot complete within
them, so the grammar never allows one), from a reset context. tok/s = tokens / wall time of the whole
run (the short prompt's prefill and the grammar's parse included, as llmc's rows include their prefill).
Rounds alternate plain and constrained; prints one JSON object (per-round figures) on stdout.

usage: bench_llamacpp_structured.py --model F.gguf --schema S.json --prompt TEXT [--tokens 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--schema", required=True, help="file holding the JSON Schema")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024,
                n_batch=512, verbose=False, seed=0)
    with open(args.schema) as f:
        schema_text = f.read()
    grammar = LlamaGrammar.from_json_schema(schema_text, verbose=False)
    prompt = llm.tokenize(args.prompt.encode())

    def run(constrained: bool, tokens: int) -> tuple[float, str]:
        llm.reset()  # no KV reuse between runs (llmc's rows reset their prefix cache too)
        out: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, temp=0.0, grammar=grammar if constrained else None):
            out.append(tok)
            if len(out) == tokens:
                break
        dt = time.perf_counter() - t0
        return tokens / dt, llm.detokenize(out).decode(errors="replace")

    run(False, 16)  # warm both paths
    run(True, 16)
    plain, cons = [], []
    text = ""
    for _ in range(args.rounds):
        plain.append(run(False, args.tokens)[0])
        tps, text = run(True, args.tokens)
        cons.append(tps)
    print(json.dumps({"plain": plain, "json_schema": cons, "threads": args.threads,
                      "llama_cpp_python": llama_cpp.__version__, "sample": text[:200]}))


if __name__ == "__main__":
    main()
