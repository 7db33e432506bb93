#!/usr/bin/env python3
"""llama.cpp benchmark through llama-cpp-python.

batch 1 : llama_cpp.Llama(n_threads=2, n_threads_batch=2), Llama.eval() + argmax
          on the returned logits (greedy; EOS ignored because we pick tokens).
batch B : same model file, a low-level context per B with n_seq_max=B (n_ctx = 512 per
          sequence); one llama_batch holds the B prompts (B sequence ids), then each decode
          step submits B tokens (one per sequence) and argmaxes B logit rows.
usage: bench_llamacpp.py --model FILE.gguf --precision P --out FILE [--batches 1,8,32] [--flash-attn]
"""
import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--precision", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--batches", default="1,8,32")
ap.add_argument("--flash-attn", action="store_true")
ap.add_argument("--serve", action="store_true", help="decode b1 on request (interleave.py), no suite")
args = ap.parse_args()

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from llama_cpp import Llama  # noqa: E402

llm = Llama(model_path=args.model, n_threads=bc.THREADS, n_threads_batch=bc.THREADS,
            n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn=args.flash_attn,
            logits_all=False, verbose=False, use_mmap=True)
P = bc.load_prompts()
n_vocab = llm.n_vocab()


def argmax_last():
    # with logits_all=False, Llama.eval() no longer copies logits into llm.scores
    # (sampling moved into llama.cpp), so read the last output row directly.
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    return int(np.argmax(row))


def gen1(prompt, n_new):
    llm.reset()
    stamps, toks = [], []
    t0 = bc.now()
    llm.eval(prompt)
    tok = argmax_last()
    toks.append(tok)
    stamps.append(bc.now())
    for _ in range(n_new - 1):
        llm.eval([tok])
        tok = argmax_last()
        toks.append(tok)
        stamps.append(bc.now())
    return toks, stamps, t0


def run_prefill():
    toks, stamps, t0 = gen1(P["prefill_512"], 1)
    ttft = stamps[0] - t0
    return {"ttft_s": ttft, "prefill_tps": 512 / ttft}


# ---- batch B via the low-level API -------------------------------------


class BatchContext:
    """A llama.cpp context for NSEQ sequences decoded together."""

    def __init__(self, nseq):
        self.nseq = nseq
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = nseq * 512
        cp.n_batch = nseq * 128
        cp.n_ubatch = 512
        cp.n_seq_max = nseq
        cp.n_threads = bc.THREADS
        cp.n_threads_batch = bc.THREADS
        cp.flash_attn_type = llm.context_params.flash_attn_type  # same as the batch-1 context
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed for n_seq_max={nseq}")
        self.batch = llama_cpp.llama_batch_init(nseq * 128, 0, nseq)

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def logits_row(self, i):
        """i = index of the token in the submitted batch (not the output row)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"no logits for batch index {i}")
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))

    def gen(self, prompts, n_new):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        b, nseq = self.batch, self.nseq
        plen = len(prompts[0])
        n = 0
        for s, p in enumerate(prompts):
            for j, t in enumerate(p):
                b.token[n] = t
                b.pos[n] = j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = s
                b.logits[n] = j == plen - 1
                n += 1
        b.n_tokens = n
        stamps, toks = [], []
        t0 = bc.now()
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed (prefill)")
        cur = [int(np.argmax(self.logits_row(s * plen + plen - 1))) for s in range(nseq)]
        toks.append(cur)
        stamps.append(bc.now())
        for step in range(1, n_new):
            for s in range(nseq):
                b.token[s] = cur[s]
                b.pos[s] = plen + step - 1
                b.n_seq_id[s] = 1
                b.seq_id[s][0] = s
                b.logits[s] = True
            b.n_tokens = nseq
            if llama_cpp.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed (step)")
            cur = [int(np.argmax(self.logits_row(s))) for s in range(nseq)]
            toks.append(cur)
            stamps.append(bc.now())
        return np.array(toks).T.tolist(), stamps, t0


if args.serve:
    bc.serve(lambda: bc.decode_metrics(*gen1(P["decode_128"], bc.N_NEW)[1:]), "llamacpp")
    sys.exit(0)

res = {"engine": "llama.cpp (llama-cpp-python)", "precision": args.precision, "model": args.model,
       "file_bytes": bc.weight_bytes(args.model),
       "versions": {"llama-cpp-python": llama_cpp.__version__},
       "flash_attn": args.flash_attn,
       "system_info": llama_cpp.llama_print_system_info().decode()}
pre = bc.repeat(run_prefill, "prefill")
res["prefill_tps"] = bc.summarize(pre, "prefill_tps")
res["prefill_runs"] = pre
for nb in bc.parse_batches(args.batches):
    tokens = []
    bctx = None
    try:
        if nb == 1:
            def run(tokens=tokens):
                toks, stamps, t0 = gen1(P["decode_128"], bc.N_NEW)
                tokens.append([toks])
                return bc.decode_metrics(stamps, t0)
        else:
            bctx = BatchContext(nb)

            def run(nb=nb, bctx=bctx, tokens=tokens):
                toks, stamps, t0 = bctx.gen(bc.batch_prompts(P, nb), bc.N_NEW)
                tokens.append(toks)
                return bc.decode_metrics(stamps, t0, batch=nb)
        runs = bc.repeat(run, f"b{nb}")
    except Exception as e:  # record, don't hide
        res[f"b{nb}_error"] = repr(e)
        continue
    finally:
        if bctx is not None:
            bctx.close()
    res[f"decode_b{nb}_tps"] = bc.summarize(runs, "decode_tps")
    res[f"e2e_b{nb}_tps"] = bc.summarize(runs, "e2e_tps")
    res[f"b{nb}_runs"] = runs
    res[f"tokens_b{nb}"] = tokens[-1]
    res[f"b{nb}_tokens_generated"] = sum(len(t) for t in tokens[-1])
    if nb == 1:
        res["tokens"] = tokens[-1][0]
        res["b1_deterministic"] = all(t == tokens[0] for t in tokens)
bc.write_result(args.out, res)
