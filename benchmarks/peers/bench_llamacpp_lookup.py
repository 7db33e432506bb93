#!/usr/bin/env python3
"""llama.cpp's prompt-lookup decoding vs its plain decode, batch 1, greedy, through llama-cpp-python.

Run with the peers venv's python (benchmarks/peers/setup.sh builds llama-cpp-python there); called by
benchmarks/bench_speculative.py with the same prompts (token ids) it gives llmc, so both engines see
identical inputs. ``lookup`` is ``llama_cpp.llama_speculative.LlamaPromptLookupDecoding`` (n-grams of
``--max-ngram`` down to 1 tokens, ``--num-pred`` drafts), driven by ``Llama.generate``; ``plain`` is
the same ``generate`` without a draft model. Each prompt starts from an empty KV cache, EOS is ignored
(the loop takes exactly ``--new-tokens`` tokens), and a rate is new tokens / wall time over all prompts
of a workload, prefill included (as llmc's figure). Methods are interleaved within each round.

usage: bench_llamacpp_lookup.py --model F.gguf --prompts P.json --out O.json [--rounds 5] [--new-tokens 128]
       P.json: {"workload": [[token ids], ...], ...}; O.json: per workload and method, tok/s of each round
       and the generated token ids of the last round.
"""
from __future__ import annotations

import argparse
import json
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--prompts", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--new-tokens", type=int, default=128)
ap.add_argument("--num-pred", type=int, default=6)
ap.add_argument("--max-ngram", type=int, default=4)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()

from llama_cpp import Llama  # noqa: E402
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: E402


def load(draft: LlamaPromptLookupDecoding | None) -> Llama:
    return Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=1024,
                 n_batch=512, draft_model=draft, verbose=False, use_mmap=True)


engines = {"plain": load(None),
           "lookup": load(LlamaPromptLookupDecoding(max_ngram_size=args.max_ngram, num_pred_tokens=args.num_pred))}
prompts: dict[str, list[list[int]]] = json.load(open(args.prompts))


def run(llm: Llama, plist: list[list[int]]) -> tuple[float, list[list[int]]]:
    """Greedy ``--new-tokens`` tokens for each prompt, one at a time: (seconds, outputs)."""
    outs = []
    t0 = time.perf_counter()
    for p in plist:
        llm.reset()  # n_tokens = 0: no prefix reuse from the previous prompt or round
        toks = []
        for tok in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            if len(toks) == args.new_tokens:
                break
        outs.append(toks)
    return time.perf_counter() - t0, outs


for llm in engines.values():  # warm-up: first evals allocate
    run(llm, [next(iter(prompts.values()))[0][:32]])
result: dict = {"model": args.model, "rounds": args.rounds, "new_tokens": args.new_tokens, "num_pred": args.num_pred,
                "max_ngram": args.max_ngram, "threads": args.threads, "workloads": {}}
for wl in prompts:
    result["workloads"][wl] = {m: {"tok_s": [], "token_ids": None} for m in engines}
for rnd in range(args.rounds):
    for wl, plist in prompts.items():
        order = list(engines) if rnd % 2 == 0 else list(engines)[::-1]  # alternate who goes first
        for m in order:
            secs, outs = run(engines[m], plist)
            cell = result["workloads"][wl][m]
            cell["tok_s"].append(round(sum(map(len, outs)) / secs, 1))
            cell["token_ids"] = outs
            print(f"round {rnd} {wl:8s} {m:6s} {cell['tok_s'][-1]:8.1f} tok/s", flush=True)
json.dump(result, open(args.out, "w"))
