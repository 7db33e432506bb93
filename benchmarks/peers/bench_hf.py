#!/usr/bin/env python3
"""HF transformers (PyTorch eager mode) greedy generate() benchmark.

usage: bench_hf.py --model DIR --dtype float32|bfloat16 [--attn sdpa|eager] --out FILE [--batches 1,8]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--dtype", default="float32")
ap.add_argument("--attn", default="sdpa")
ap.add_argument("--out", required=True)
ap.add_argument("--batches", default="1,8")
args = ap.parse_args()

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

torch.set_num_threads(bc.THREADS)
torch.set_num_interop_threads(1)
dtype = getattr(torch, args.dtype)
model = LlamaForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn).eval()
P = bc.load_prompts()


class Stamper(BaseStreamer):
    """put() is called once with the prompt, then once per generated step."""

    def __init__(self):
        self.n = 0
        self.stamps = []

    def put(self, value):
        if self.n > 0:
            self.stamps.append(bc.now())
        self.n += 1

    def end(self):
        pass


def gen(prompts, n_new):
    ids = torch.tensor(prompts, dtype=torch.long)
    st = Stamper()
    t0 = bc.now()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
            num_beams=1, eos_token_id=None, pad_token_id=P["eos"], streamer=st,
            use_cache=True)
    return out[:, ids.shape[1]:].tolist(), st.stamps, t0


def run_prefill():
    toks, stamps, t0 = gen([P["prefill_512"]], 1)
    ttft = stamps[0] - t0
    return {"ttft_s": ttft, "prefill_tps": 512 / ttft}


res = {"engine": "hf-transformers", "precision": args.dtype, "attn": args.attn,
       "model": args.model, "file_bytes": bc.weight_bytes(args.model),
       # bytes of the weights as held in memory (bf16 run loads the fp32 file and casts)
       "mem_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
       "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
       "torch_threads": torch.get_num_threads()}
pre = bc.repeat(run_prefill, "prefill")
res["prefill_tps"] = bc.summarize(pre, "prefill_tps")
res["prefill_runs"] = pre
for b in bc.parse_batches(args.batches):
    tokens = []

    def run(b=b, tokens=tokens):
        toks, stamps, t0 = gen(bc.batch_prompts(P, b), bc.N_NEW)
        tokens.append(toks)
        return bc.decode_metrics(stamps, t0, batch=b)

    runs = bc.repeat(run, f"b{b}")
    res[f"decode_b{b}_tps"] = bc.summarize(runs, "decode_tps")
    res[f"e2e_b{b}_tps"] = bc.summarize(runs, "e2e_tps")
    res[f"b{b}_runs"] = runs
    res[f"tokens_b{b}"] = tokens[-1]
    res[f"b{b}_tokens_generated"] = sum(len(t) for t in tokens[-1])
    if b == 1:
        res["tokens"] = tokens[-1][0]
        res["b1_deterministic"] = all(t == tokens[0] for t in tokens)
bc.write_result(args.out, res)
