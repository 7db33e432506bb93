"""Shared helpers for the per-engine benchmark scripts.

Definitions used by every engine (so numbers are comparable):
  prefill tok/s  = 512 / TTFT, TTFT = time from handing the 512-token prompt to
                   the engine until the first generated token id is available.
  decode b1 tok/s= (N-1) / (t_N - t_1) for one 128-token prompt, N = 128 new
                   tokens, t_i = time token i became available (generation
                   phase only; the prompt pass is excluded).
  decode bB tok/s= B*(N-1) / (t_N - t_1) for B different 128-token prompts
                   decoded together (aggregate over the batch); B in --batches (1,8,32).
  e2e figures    = new tokens / total wall time (incl. prefill) are stored too.
Each figure is the median of REPEATS timed runs after WARMUP untimed run(s).
Greedy decoding everywhere; EOS is never allowed to stop generation.
Peak RSS = ru_maxrss of the benchmark process at the end (whole suite,
including the batch-8 run).
"""
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.environ.get("PEERS_ROOT", os.path.expanduser("~/.cache/llmc-peers"))
PROMPTS = os.environ.get("BENCH_PROMPTS", f"{ROOT}/prompts.json")
THREADS = int(os.environ.get("BENCH_THREADS", "2"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
N_NEW = 128
N_AGREE = 32

now = time.perf_counter


def make_prompts(tokenizer_json=None):
    """Deterministic prompt token ids from CPython's own docs text (tokenizer: the 110M model's, else the 1B's, else
    the one make_model.py keeps for every shape; it trains the same BPE for all of them)."""
    if tokenizer_json is None:
        tokenizer_json = next((f"{ROOT}/{m}/tokenizer.json" for m in ("model", "model-1b", "tokenizer")
                               if os.path.exists(f"{ROOT}/{m}/tokenizer.json")), f"{ROOT}/model/tokenizer.json")
    import pydoc_data.topics as t

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer_json)
    text = "\n".join(t.topics[k] for k in sorted(t.topics))
    ids = tok.encode(text, add_special_tokens=False).ids
    bos = tok.token_to_id("<s>")
    eos = tok.token_to_id("</s>")
    assert eos not in ids
    p = {
        "bos": bos, "eos": eos,
        "prefill_512": [bos] + ids[0:511],
        "decode_128": [bos] + ids[3000:3127],
        "batch32_128": [[bos] + ids[6000 + 400 * k: 6000 + 400 * k + 127] for k in range(32)],
    }
    assert len(p["prefill_512"]) == 512 and len(p["decode_128"]) == 128
    assert all(len(x) == 128 for x in p["batch32_128"])
    json.dump(p, open(PROMPTS, "w"))
    return p


def load_prompts():
    if not os.path.exists(PROMPTS):
        return make_prompts()
    return json.load(open(PROMPTS))


def batch_prompts(p, b):
    """B different 128-token prompts (batch 1 uses the decode_128 prompt, like the other engines)."""
    return [p["decode_128"]] if b == 1 else p["batch32_128"][:b]


def parse_batches(text):
    return [int(x) for x in text.split(",") if x.strip()]


def median(xs):
    return statistics.median(xs) if xs else None


def repeat(fn, label, warmup=None, repeats=None):
    """Run fn() warmup+repeats times; fn returns a dict of metrics. Return list of timed dicts."""
    warmup = WARMUP if warmup is None else warmup
    repeats = REPEATS if repeats is None else repeats
    for _ in range(warmup):
        fn()
    out = []
    for i in range(repeats):
        r = fn()
        out.append(r)
        print(f"  [{label}] run {i}: " + ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in r.items() if not isinstance(v, list)), file=sys.stderr, flush=True)
    return out


def decode_metrics(stamps, t0, batch=1):
    """stamps: times at which tokens 1..N became available (per step)."""
    n = len(stamps)
    gen = stamps[-1] - stamps[0]
    return {
        "batch": batch,
        "ttft_s": stamps[0] - t0,
        "decode_tps": batch * (n - 1) / gen if gen > 0 else float("nan"),
        "e2e_tps": batch * n / (stamps[-1] - t0),
        "n_new": n,
    }


def summarize(runs, key):
    return median([r[key] for r in runs])


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def dir_size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    tot = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            tot += os.path.getsize(os.path.join(dp, f))
    return tot


def weight_bytes(path, exts=(".safetensors", ".onnx", ".data", ".bin", ".gguf")):
    """Bytes of weight files only (excludes tokenizer/config)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    tot = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            if f.endswith(exts):
                tot += os.path.getsize(os.path.join(dp, f))
    return tot


def write_result(out, res):
    res["peak_rss_mb"] = peak_rss_mb()
    res.setdefault("threads", THREADS)
    res.setdefault("repeats", REPEATS)
    res.setdefault("warmup", WARMUP)
    res["argv"] = sys.argv
    os.makedirs(os.path.dirname(out), exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_runs") and not k.startswith("tokens")},
                     indent=1))


def serve(run_once, label):
    """Worker side of interleave.py: after one warm-up run, answer each ``run`` line on stdin with one timed
    run's metrics as a JSON line on stdout (prefixed ``@@`` so library chatter on stdout cannot be mistaken for
    it); ``quit`` or EOF ends the loop.  The engine stays loaded between runs, so the controller can alternate
    engines every few seconds and give each the same share of this machine's drifting memory bandwidth."""
    run_once()
    print("@@" + json.dumps({"ready": label, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd != "run":
            print("@@" + json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)
            continue
        t_start = time.time()
        r = run_once()
        r.update(start=t_start, end=time.time())
        print("@@" + json.dumps(r), flush=True)
