"""The ``engine`` section of ``scripts/gpu_check.py``: llmc's CUDA engine on the 1B shape, on this GPU.

Builds the engines here (``benchmarks/peers/make_model.py 1b``: Llama-3.2-1B shape, vocab 8192, random
weights; ``llmc build --gpu auto`` in bfloat16, ``--quant fp8`` and ``--quant int4`` (RTN: fits the budget)),
then measures:

- parity: greedy tokens of the bf16 engine vs transformers (bf16, same GPU) on 3 prompts x 32 tokens;
  at a first divergence, the top-2 gap of transformers' logits there (a tie within bf16 rounding or not);
- CUDA-graph replay vs eager: the same greedy tokens, and decode speed of each;
- decode tok/s at batch 1/8/64 (128-token prompts, 128 new tokens) and prefill tok/s of a 2048-token
  prompt, side by side with transformers on the same GPU (eager with a static cache, and
  ``torch.compile(mode="reduce-overhead")`` at batch 1 when the time budget allows);
- each decode row's fraction of the HBM roofline: (weight bytes + KV bytes read per step) / step time,
  over this device's measured copy bandwidth;
- fp8 and int4 engines: decode b1 and b64 against the bf16 engine, right after the bf16 rows (before transformers').
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, NEW_TOKENS, BATCHES, PREFILL_LEN = 128, 128, (1, 8, 64), 2048


QUANT_LABEL = {"fp8": "fp8", "int4": "int4"}  # engine key -> what --quant built it (RTN: no calibration)
QUANT_BATCHES = (1, 64)


def _llmc(*args, log: list) -> tuple[int, float, str]:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", *map(str, args)], capture_output=True, text=True)
    log.append({"cmd": "llmc " + " ".join(map(str, args)), "rc": proc.returncode, "s": round(time.time() - t0, 1),
                "tail": (proc.stdout + proc.stderr)[-1500:]})
    return proc.returncode, time.time() - t0, proc.stdout + proc.stderr


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-1500:]


def _copy_bandwidth() -> float:
    import torch

    n = 1 << 31
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / sorted(times)[5]


def _decode_rate(engine, prompts, params) -> float:
    """Generated tokens after the first, per second of the decode phase (all prompts in one batch)."""
    outs = engine.generate(prompts, params)
    first = max(o.ttft for o in outs)
    last = max(o.latency for o in outs)
    n = sum(len(o.token_ids) - 1 for o in outs)
    return n / (last - first)


def _weight_bytes(engine_dir: Path) -> int:
    return (engine_dir / "weights.safetensors").stat().st_size


def _make_checkpoint(work: Path, res: dict) -> Path | None:
    """The 1B-shape random checkpoint under ``work`` (None, with ``res["error"]``, when make_model.py fails)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/peers/make_model.py"), "1b"],
                          env=dict(os.environ, PEERS_ROOT=str(work / "peers")), capture_output=True, text=True)
    res["make_model_s"] = round(time.time() - t0, 1)
    if proc.returncode:
        res["error"] = "make_model.py failed: " + (proc.stdout + proc.stderr)[-2000:]
        return None
    return work / "peers" / "model-1b"


def _prefill_rate(engine, ids: list[int]) -> float:
    """Tokens per second of one warm ``score`` of ``ids`` (a single prefill step)."""
    import torch

    engine.score(ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.score(ids)
    return len(ids) / (time.perf_counter() - t)


def _sampling_rows(engine, rng, vocab: int) -> list[dict]:
    """Batch-64 seeded top-p sampling: tok/s with the device sampler and with the host (numpy) one, same tokens."""
    from llmc.runtime import SamplingParams

    ps = [rng.integers(3, vocab, PROMPT_LEN).tolist() for _ in range(64)]
    seeds = rng.integers(1 << 31, size=64).tolist()
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s)
              for s in seeds]
    rows, tokens = [], []
    for where in ("device", "host"):
        engine._session.samples_on_device = where == "device"
        engine.reset_prefix_cache()
        t = time.perf_counter()
        outs = engine.generate(ps, params)
        secs = time.perf_counter() - t
        tokens.append([o.token_ids for o in outs])
        rows.append({"sampler": where, "batch": 64, "tok_s": 64 * NEW_TOKENS / secs})
    engine._session.samples_on_device = True
    same = sum(a == b for x, y in zip(*tokens, strict=True) for a, b in zip(x, y, strict=True))
    for r in rows:
        r["same_tokens_frac"] = same / (64 * NEW_TOKENS)
    print(rows, flush=True)
    return rows


def run_quick(report: dict) -> dict:
    """The bf16 engine alone, for a short lease: build, CUDA graphs vs eager tokens, decode b1/8/64, prefill."""
    import numpy as np

    from llmc.runtime import Engine, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="llmc-gpu-"))
    res: dict = {"ok": False, "builds": [], "quick": True}
    report["engine"] = res
    ckpt = _make_checkpoint(work, res)
    if ckpt is None:
        return res
    out = work / "engine-bf16"
    rc, secs, log = _llmc("build", ckpt, "--gpu", "auto", "-o", out, "--cache-dir", work / "cache", "-q",
                          log=res["builds"])
    print(f"build bf16: rc {rc} in {secs:.0f} s", flush=True)
    if rc:
        res["error"] = "bf16 build failed: " + log[-2000:]
        return res
    res["engine_dir"] = str(out)  # the bf16 engine, for the profile section
    manifest = json.loads((out / "manifest.json").read_text())
    res["kernels"] = {v: sum(1 for k in manifest["engine"]["kernels"] if k["variant"] == v)
                      for v in ("flash-prefill", "flash-decode", "flash-reduce", "decode", "prefill", "fused")}
    e = Engine.load(out, max_num_tokens=max(PREFILL_LEN, max(BATCHES) * PROMPT_LEN), kv_cache_tokens=65536,
                    verify=False)
    eager = Engine.load(out, cuda_graphs=False, kv_cache_tokens=8192, verify=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg["vocab_size"], n).tolist() for n in (9, 40, 100)]
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    got = [o.token_ids for o in e.generate(prompts, greedy)]
    res["graphs_equal_eager"] = [o.token_ids for o in eager.generate(prompts, greedy)] == got
    print(f"graphs == eager: {res['graphs_equal_eager']}", flush=True)
    copy_bw = _copy_bandwidth()
    res["copy_bandwidth_gbs"] = copy_bw / 1e9
    layers, hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    wbytes = _weight_bytes(out)
    rows = []
    for label, engine, batches in (("llmc bf16 (CUDA graphs, fused kernels)", e, BATCHES),
                                   ("llmc bf16 eager", eager, (1,))):
        for b in batches:
            ps = [rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(b)]
            _decode_rate(engine, ps, SamplingParams(max_tokens=8, ignore_eos=True))
            rate = _decode_rate(engine, ps, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            step_bytes = wbytes + b * (PROMPT_LEN + NEW_TOKENS / 2) * 2 * layers * hkv * d * 2
            rows.append({"who": label, "batch": b, "tok_s": rate, "roofline_frac": rate / b * step_bytes / copy_bw})
            print(rows[-1], flush=True)
    res["rows"] = rows
    ids = rng.integers(3, cfg["vocab_size"], PREFILL_LEN).tolist()
    res["prefill_llmc_tok_s"] = _prefill_rate(e, ids)
    res["ok"] = res["graphs_equal_eager"]
    return res


def run_engine(budget_s: float, t_start: float, report: dict) -> dict:
    import numpy as np
    import torch

    from llmc.runtime import Engine, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="llmc-gpu-"))
    res: dict = {"ok": False, "builds": [], "workdir": str(work)}
    report["engine"] = res
    ckpt = _make_checkpoint(work, res)
    if ckpt is None:
        return res
    cache = work / "cache"
    eng = {q: work / f"engine-{q}" for q in ("bf16", "fp8", "int4")}
    rc, secs, out = _llmc("build", ckpt, "--gpu", "auto", "-o", eng["bf16"], "--cache-dir", cache, "-q",
                          log=res["builds"])
    print(f"build bf16: rc {rc} in {secs:.0f} s", flush=True)
    if rc:  # measure what can be measured without the AOT kernels (torch attention, no CUDA graphs)
        print(out[-3000:], flush=True)
        os.environ["LLMC_CUDA_NO_AOT"] = "1"
        res["no_aot_fallback"] = True
        rc, secs, out = _llmc("build", ckpt, "--gpu", "auto", "-o", eng["bf16"], "--cache-dir", cache, "-q",
                              "--force", log=res["builds"])
        if rc:
            res["error"] = "bf16 build failed: " + out[-2000:]
            return res
    res["engine_dir"] = str(eng["bf16"])  # for the profile section
    # The quantized builds calibrate and score on the CPU: run them while the GPU checks parity.
    # A short calibration and accuracy report: this measures speed, and the last H200 run lost the fp8 build to
    # the time budget. int4 RTN rather than AWQ: the last H100 run lost the AWQ build to the budget (issue 51).
    # On the CPU: the GPU is busy with the checks below (section "calibration" of gpu_check.py calibrates there).
    short = ["--calib-samples", "8", "--calib-seq-len", "128", "--eval-tokens", "512", "--calib-device", "cpu"]
    quant_args = {"fp8": ["--quant", "fp8", *short], "int4": ["--quant", "int4", *short]}
    logs = {q: open(work / f"build-{q}.log", "w+") for q in quant_args}  # noqa: SIM115 - read after wait
    bg = {q: subprocess.Popen([sys.executable, "-m", "llmc.cli.main", "build", str(ckpt), "--gpu", "auto", "-o",
                               str(eng[q]), "--cache-dir", str(cache / q), "-q", *a],
                              stdout=logs[q], stderr=subprocess.STDOUT, text=True)
          for q, a in quant_args.items()}
    bg_t0 = time.time()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    texts = ["The for statement is used to iterate over", "Exceptions are raised when",
             "A class definition defines a class object, and its suite is executed in a new execution frame"]
    prompts = [tok(t).input_ids for t in texts]
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    want = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            want.append(hf.generate(x, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(ids):].tolist())
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    kv_tokens = 65536  # 2 GiB of KV on this shape: every request below fits at once
    e = Engine.load(eng["bf16"], max_num_tokens=max(PREFILL_LEN, max(BATCHES) * PROMPT_LEN), kv_cache_tokens=kv_tokens)
    got = [o.token_ids for o in e.generate(prompts, greedy)]
    single = [e.generate([p], greedy)[0].token_ids for p in prompts]
    parity = []
    for ids, w, g in zip(prompts, want, got, strict=True):
        row = {"prompt_tokens": len(ids), "identical": w == g, "agree": sum(a == b for a, b in zip(w, g, strict=True))}
        if w != g:
            i = next(j for j, (a, b) in enumerate(zip(w, g, strict=True)) if a != b)
            with torch.inference_mode():
                logits = hf(torch.tensor([ids + w[:i]], device="cuda")).logits[0, -1].float()
            top = torch.topk(logits, 2)
            gap = float(top.values[0] - top.values[1])
            ulp = float(top.values.abs().max()) * 2.0**-7  # two bf16 rounding steps at that magnitude
            row.update(first_divergence=i, hf_token=w[i], llmc_token=g[i], top2=top.indices.tolist(),
                       top2_gap=gap, bf16_2ulp=ulp, llmc_token_in_top2=g[i] in top.indices.tolist(),
                       tie_within_bf16=gap <= ulp and g[i] in top.indices.tolist())
        parity.append(row)
    res["parity"] = parity
    res["batched_equals_single"] = got == single
    res["attention_route"] = e._session.attention_route
    eager = Engine.load(eng["bf16"], cuda_graphs=False, max_num_tokens=max(BATCHES) * PROMPT_LEN,
                        kv_cache_tokens=kv_tokens, verify=False)
    res["graphs_equal_eager"] = [o.token_ids for o in eager.generate(prompts, greedy)] == got
    print(f"parity: {parity}\nbatched == single: {res['batched_equals_single']}, graphs == eager: "
          f"{res['graphs_equal_eager']}", flush=True)

    # Timings: wait for the CPU-heavy quantized builds first, so the host is quiet.
    for q, p in bg.items():
        remaining = max(1.0, budget_s - (time.time() - t_start) - 150)
        try:
            p.wait(timeout=remaining)
            res["builds"].append({"cmd": f"llmc build --gpu auto {' '.join(quant_args[q])}", "rc": p.returncode,
                                  "s": round(time.time() - bg_t0, 1), "tail": _tail(logs[q])})
        except subprocess.TimeoutExpired:
            p.kill()
            res["builds"].append({"cmd": f"llmc build {q}", "rc": None, "tail": "killed: time budget"})
    copy_bw = _copy_bandwidth()
    res["copy_bandwidth_gbs"] = copy_bw / 1e9
    cfg = json.loads((ckpt / "config.json").read_text())
    layers, hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    rng = np.random.default_rng(0)
    decode = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rows = []
    wbytes = _weight_bytes(eng["bf16"])
    for label, engine in (("llmc bf16 (CUDA graphs)", e), ("llmc bf16 eager", eager)):
        for b in BATCHES if engine is e else (1,):
            ps = [rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(b)]
            _decode_rate(engine, ps, SamplingParams(max_tokens=8, ignore_eos=True))  # warm: graphs captured
            rate = _decode_rate(engine, ps, decode)
            ctx = PROMPT_LEN + NEW_TOKENS / 2
            step_bytes = wbytes + b * ctx * 2 * layers * hkv * d * 2
            rows.append({"who": label, "batch": b, "tok_s": rate,
                         "roofline_frac": rate / b * step_bytes / copy_bw})
            print(rows[-1], flush=True)
    # The quantized engines next (issue 51: fp8 and int4 against bf16 at batch 1 and 64 first, then the rest).
    rows += _quant_rows(eng, cfg, rng, prompts, got, copy_bw, {r["batch"]: r["tok_s"] for r in rows
                                                                if r["who"] == "llmc bf16 (CUDA graphs)"})
    res["rows"] = rows
    res["sampling"] = _sampling_rows(e, rng, cfg["vocab_size"])
    ids = rng.integers(3, cfg["vocab_size"], PREFILL_LEN).tolist()
    res["prefill_llmc_tok_s"] = _prefill_rate(e, ids)
    res["graph_replays"], res["eager_steps"] = e._session.graph_replays, e._session.eager_steps
    del eager

    # transformers on the same GPU: eager with a static cache, then compiled (reduce-overhead)
    def hf_rate(b: int, compiled: bool = False) -> float:
        # transformers compiles the forward by itself when the cache is static: disable_compile keeps eager
        # eager; the compiled row warms up with the timed lengths so no compilation lands in the timing.
        x = torch.tensor([rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(b)], device="cuda")
        kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, disable_compile=not compiled)
        with torch.inference_mode():
            for n in ((1, NEW_TOKENS) if compiled else (4,)):
                hf.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            t_pre = time.perf_counter() - t
            t = time.perf_counter()
            hf.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kw)
            torch.cuda.synchronize()
            total = time.perf_counter() - t
        return b * (NEW_TOKENS - 1) / (total - t_pre)

    for b in BATCHES:
        rows.append({"who": "transformers eager (static cache)", "batch": b, "tok_s": hf_rate(b)})
        print(rows[-1], flush=True)
    with torch.inference_mode():
        x = torch.tensor([ids], device="cuda")
        hf(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf(x)
        torch.cuda.synchronize()
        res["prefill_transformers_tok_s"] = PREFILL_LEN / (time.perf_counter() - t)

    if time.time() - t_start < budget_s - 120:
        try:
            t = time.time()
            rate = hf_rate(1, compiled=True)  # transformers' own compile of the static-cache decode step
            rows.append({"who": "transformers torch.compile reduce-overhead", "batch": 1, "tok_s": rate,
                         "compile_and_warm_s": round(time.time() - t, 1)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"who": "transformers torch.compile reduce-overhead", "batch": 1, "tok_s": None,
                         "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(rows[-1], flush=True)
    else:
        rows.append({"who": "transformers torch.compile reduce-overhead", "batch": 1, "tok_s": None,
                     "error": "skipped: time budget"})
    res["ok"] = all(r["identical"] or r.get("tie_within_bf16") for r in parity) and res["graphs_equal_eager"]
    return res


def _quant_rows(eng: dict, cfg: dict, rng, prompts: list, got: list, copy_bw: float, bf16: dict) -> list[dict]:
    """Decode rows of the fp8 and int4 engines at QUANT_BATCHES, each against the bf16 engine at the same batch."""
    from llmc.runtime import Engine, SamplingParams

    rows = []
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    decode = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for q in ("fp8", "int4"):
        who = f"llmc {QUANT_LABEL[q]}"
        if not (eng[q] / "manifest.json").is_file():
            rows.append({"who": who, "batch": 1, "tok_s": None, "error": "build failed or was cut"})
            print(rows[-1], flush=True)
            continue
        try:
            qe = Engine.load(eng[q], kv_cache_tokens=max(QUANT_BATCHES) * (PROMPT_LEN + NEW_TOKENS + 16),
                             max_num_tokens=max(PREFILL_LEN, max(QUANT_BATCHES) * PROMPT_LEN))
            agree = [o.token_ids for o in qe.generate(prompts, greedy)]
            agree_frac = sum(a == b for x, y in zip(agree, got, strict=True)
                             for a, b in zip(x, y, strict=True)) / (32 * len(prompts))
            for b in QUANT_BATCHES:
                ps = [rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(b)]
                _decode_rate(qe, ps, SamplingParams(max_tokens=8, ignore_eos=True))  # warm: graphs captured
                rate = _decode_rate(qe, ps, decode)
                rows.append({"who": who, "batch": b, "tok_s": rate, "vs_bf16": rate / bf16[b] if bf16.get(b) else None,
                             "roofline_frac": rate / b * _weight_bytes(eng[q]) / copy_bw,
                             "greedy_agree_with_bf16": agree_frac})
                print(rows[-1], flush=True)
            del qe
        except Exception as exc:  # noqa: BLE001 - reported, the rest goes on
            rows.append({"who": who, "batch": 1, "tok_s": None, "error": f"{type(exc).__name__}: {exc}"})
            print(rows[-1], flush=True)
    return rows


def run_profile(report: dict, batches: tuple[int, ...] = (1, 64), steps: int = 10) -> dict:
    """Where a decode step's time goes on the bf16 engine the engine section built: per-kernel device times of
    ``steps`` decode steps (llmc.runtime.workers.cuda.step_profile) at each batch, grouped by kind of work."""
    import numpy as np

    from llmc.runtime import Engine
    from llmc.runtime.workers.cuda.step_profile import format_profile, profile_decode

    path = report.get("engine", {}).get("engine_dir")
    if not path:
        return {"ok": False, "error": "no bf16 engine: the engine section did not build one"}
    cfg = json.loads((Path(path) / "hf_config.json").read_text())
    engine = Engine.load(path, kv_cache_tokens=max(batches) * (PROMPT_LEN + 2 * steps + 8), verify=False)
    rng = np.random.default_rng(0)
    res: dict = {"ok": True, "engine_dir": path, "profiles": []}
    for b in batches:
        prompts = [rng.integers(3, cfg["vocab_size"], PROMPT_LEN).tolist() for _ in range(b)]
        prof = profile_decode(engine, prompts, steps=steps)
        print(format_profile(prof), flush=True)
        res["profiles"].append(prof.as_dict())
    return res
