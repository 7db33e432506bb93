#!/usr/bin/env python3
"""ONNX Runtime GenAI benchmark (CPU EP), greedy search, token ids in.

usage: bench_ortgenai.py --model DIR (built by onnxruntime_genai.models.builder) --precision P --out FILE
                         [--batches 1,8,32]
Threads: intra_op_num_threads=BENCH_THREADS, inter_op_num_threads=1 via Config.overlay().
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--precision", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--batches", default="1,8,32")
ap.add_argument("--serve", action="store_true", help="decode b1 on request (interleave.py), no suite")
args = ap.parse_args()

import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402
import onnxruntime_genai as og  # noqa: E402

cfg = og.Config(args.model)
cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
    "intra_op_num_threads": bc.THREADS, "inter_op_num_threads": 1}}}}))
model = og.Model(cfg)
P = bc.load_prompts()


def gen(prompts, n_new):
    b, plen = len(prompts), len(prompts[0])
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, num_beams=1, batch_size=b,
                              max_length=plen + n_new, min_length=plen + n_new)
    g = og.Generator(model, params)
    arr = np.asarray(prompts, dtype=np.int32)
    stamps, toks = [], []
    t0 = bc.now()
    g.append_tokens(arr if b > 1 else arr[0])
    for _ in range(n_new):
        g.generate_next_token()
        toks.append(g.get_next_tokens().tolist())
        stamps.append(bc.now())
    del g
    return np.array(toks).T.tolist(), stamps, t0


def run_prefill():
    toks, stamps, t0 = gen([P["prefill_512"]], 1)
    ttft = stamps[0] - t0
    return {"ttft_s": ttft, "prefill_tps": 512 / ttft}


if args.serve:
    bc.serve(lambda: bc.decode_metrics(*gen([P["decode_128"]], bc.N_NEW)[1:]), "ortgenai")
    sys.exit(0)

res = {"engine": "onnxruntime-genai", "precision": args.precision, "model": args.model,
       "file_bytes": bc.weight_bytes(args.model),
       "versions": {"onnxruntime-genai": og.__version__, "onnxruntime": onnxruntime.__version__}}
pre = bc.repeat(run_prefill, "prefill")
res["prefill_tps"] = bc.summarize(pre, "prefill_tps")
res["prefill_runs"] = pre
for b in bc.parse_batches(args.batches):
    tokens = []

    def run(b=b, tokens=tokens):
        toks, stamps, t0 = gen(bc.batch_prompts(P, b), bc.N_NEW)
        tokens.append(toks)
        return bc.decode_metrics(stamps, t0, batch=b)

    try:
        runs = bc.repeat(run, f"b{b}")
    except Exception as e:  # record, don't hide
        res[f"b{b}_error"] = repr(e)
        continue
    res[f"decode_b{b}_tps"] = bc.summarize(runs, "decode_tps")
    res[f"e2e_b{b}_tps"] = bc.summarize(runs, "e2e_tps")
    res[f"b{b}_runs"] = runs
    res[f"tokens_b{b}"] = tokens[-1]
    res[f"b{b}_tokens_generated"] = sum(len(t) for t in tokens[-1])
    if b == 1:
        res["tokens"] = tokens[-1][0]
        res["b1_deterministic"] = all(t == tokens[0] for t in tokens)
bc.write_result(args.out, res)
