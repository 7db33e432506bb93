#!/usr/bin/env python3
"""llama.cpp's structured outputs beside llmc's: decode tok/s at batch 1 with and without a JSON Schema.

Runs under the peers venv (llama-cpp-python; benchmarks/peers/setup.sh), called by
benchmarks/bench_structured.py with the same schema, prompt and token count as its llmc rows. The schema
becomes a GBNF grammar with llama-cpp-python's own converter (``LlamaGrammar.from_json_schema``, what its
``response_format={"type": "json_object", "schema": ...}`` uses); generation is greedy
(``create_completion(temperature=0)``), EOS banned by a logit bias in both runs (the schema cannot
complete within the tokens anyway), so both decode exactly ``--tokens`` tokens and differ by the grammar.
tok/s = generated tokens / wall time of the call (the short prompt's prefill included, as in llmc's rows).
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
    no_eos = {llm.token_eos(): -1e9}

    def run(constrained: bool, tokens: int) -> tuple[float, str]:
        t0 = time.perf_counter()
        out = llm.create_completion(args.prompt, max_tokens=tokens, temperature=0.0, logit_bias=no_eos,
                                    grammar=grammar if constrained else None)
        dt = time.perf_counter() - t0
        n = out["usage"]["completion_tokens"]
        if n != tokens:
            kind, text = "json_schema" if constrained else "plain", out["choices"][0]["text"][:200]
            raise SystemExit(f"llama.cpp generated {n} tokens, not {tokens} ({kind}: {text!r})")
        return n / dt, out["choices"][0]["text"]

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
