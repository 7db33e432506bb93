#!/usr/bin/env python3
"""llmc worker for interleave.py: load one llmc engine and decode the peers' batch-1 prompt on request.

usage: bench_llmc_serve.py ENGINE_DIR      (run by the Python that has llmc, e.g. $LLMC_PYTHON)
Same prompt as the peers (prompts.json decode_128), 128 new tokens, greedy, EOS ignored, prefix caching off
(every run repeats the prompt); tok/s = (N - 1) / (t_N - t_1) as llmc bench and bench_common define it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from llmc.bench.workloads import decode_run  # noqa: E402
from llmc.runtime import Engine  # noqa: E402

engine = Engine.load(sys.argv[1], num_threads=bc.THREADS, kv_cache_tokens=1024, enable_prefix_caching=False)
prompt = bc.load_prompts()["decode_128"]


def run_once() -> dict:
    r = decode_run(engine, [prompt], bc.N_NEW)
    if r["tokens"] != bc.N_NEW:
        raise RuntimeError(f"llmc made {r['tokens']} tokens, not {bc.N_NEW}")
    return {"decode_tps": r["tok_s"], "ttft_s": r["ttft_s"], "n_new": r["tokens"], "batch": 1}


bc.serve(run_once, "llmc")
