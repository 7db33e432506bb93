"""Speculative decoding on the CPU: plain decode vs prompt lookup (ngram) vs a draft model, interleaved.

Targets (the default model's tokenizer):

- ``default``: the bundled default model (14M parameters). It barely copies from its context, so
  prompt lookup's drafts are rarely kept even where the answer repeats the prompt.
- ``copy`` (on by default; ``--no-copy-model`` skips it): a model that copies, as real LLMs do
  (induction heads), which is what prompt lookup lives on. None could be trained from scratch on these
  2 cores: the default model fine-tuned on quoted passages (3 runs, 10-16 min each), and probes with
  dense repeated spans and an auxiliary loss pulling heads into an induction circuit, stayed on the
  plateau before induction heads form (~11M tokens at this batch and context: Aoyama et al. 2025;
  docs/speculative.md has the runs). So this target starts from a hand-set induction circuit
  (``scripts/train_default_model.py --plant-induction``: 2 layers, 3.4M parameters; the circuit
  copies what followed an earlier occurrence of the last two tokens) and is trained on the pydoc text
  around it (``COPY_TRAIN_ARGS``, ~2 min, on first use; cached in ``~/.cache/llmc-spec``). It is
  smaller than the default model, so its steps cost less and more of each is fixed overhead: the
  default model's rows stay beside it.

Draft: ``assets/default-draft-model`` (0.9M parameters, same tokenizer). Greedy, ``--new-tokens``
(128) new tokens per request, EOS ignored. Workloads (held-out pydoc text, never seen in training):

- ``repeat``: a passage (900 characters), a blank line, then the passage's first line again: the
  answer repeats text from the prompt (a quoted passage continued).
- ``free``: 64 tokens of held-out text; free continuation.

(The committed figures before this version ran "batch 8" with 4 prompts: only 4 held-out documents
are long enough, and each gave one prompt.)

Batch 1 (each prompt alone; rate = new tokens / wall time over all prompts, prefill included) and
batch 8 (all prompts in one ``generate``). ``--rounds`` rounds; in each, every (target, workload,
batch) group runs its methods (and ``control``: plain decode again, whose ratio to plain is the
measurement's own spread) back to back in an order that rotates by round, so the shared
machine's drift hits them alike, after one untimed round (ORT's first step of each token count
costs up to 2x). The methods run on one engine per target, its speculator swapped
(``Engine.set_speculator``): separate engines of the same files ran 2-6% apart, plain against plain
(memory placement), which the committed figures before this version include. A row reports the
median tok/s over rounds and the median, min and max of its per-round ratio to the same round's
plain run. Every speculative run's tokens are compared
with the plain run's (greedy speculation must be exact).

llama.cpp beside it (``--llama-cpp``, default on when the peers venv of benchmarks/peers/setup.sh
has llama-cpp-python): the same checkpoints converted to f32 GGUF (benchmarks/peers/convert_gguf.py),
the same prompts' token ids, batch 1, plain vs ``LlamaPromptLookupDecoding``
(benchmarks/peers/bench_llamacpp_lookup.py), run after llmc's rounds with its own interleaving.

    python benchmarks/bench_speculative.py [--rounds 16] [--min-seconds 0.5] [--threads 2] [--prompts 4]
                                           [--no-copy-model]

Prints a table and writes ``benchmarks/results/bench_speculative.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "bench_speculative.json"
CACHE = Path(os.environ.get("LLMC_SPEC_CACHE", Path.home() / ".cache" / "llmc-spec"))
PEERS = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache" / "llmc-peers"))
# The copy model: a hand-set induction circuit (frozen) with the rest trained on the pydoc text, half of the windows
# quoting a passage again. Held-out perplexity 295 (the default model's: 177), quoted-passage NLL 1.57 (the default
# model's: 5.29). Tried here: hidden 384 / 6 heads copies as well but each verified token costs 1.7x more
# (repeat 1.5-1.9x vs 2.05x); trained freely instead of frozen, the circuit was unlearned (0.82 before training,
# 4.9 after 200 steps); 400 steps overfit the 100K-token corpus (perplexity 229 at step 200, 338 at 400).
COPY_TRAIN_ARGS = ["--plant-induction", "--layers", "2", "--hidden-size", "256", "--heads", "4", "--kv-heads", "4",
                   "--intermediate-size", "512", "--steps", "200", "--batch-size", "8", "--seq-len", "256",
                   "--lr", "1e-3", "--warmup", "20", "--repeat-fraction", "0.5", "--random-passages", "0.3",
                   "--log-every", "50", "--eval-every", "0"]
# "control" is plain decode again, timed like the others: its ratio to plain is the measurement's own spread, what
# a method's figure must clear to differ from plain.
METHODS = ("plain", "ngram", "draft", "control")


def build(model: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(model), "-o", str(out), "-q"], check=True)
    return out


def workloads(tokenizer, n: int) -> dict[str, list[list[int]]]:
    """``n`` ``repeat`` and ``free`` prompts (token ids) from held-out documents.

    Only 4 held-out documents are longer than 1500 characters, so prompts start at line starts 1500
    characters apart in them, taken round-robin (the first ``n``), so that batch 8 has 8 prompts.
    """
    from llmc.quant.corpus import pydoc_texts

    docs = [d for d in pydoc_texts("heldout") if len(d) > 1500]
    texts = []
    for offset in range(0, max(map(len, docs)), 1500):
        for d in docs:
            start = 0 if offset == 0 else d.find("\n", offset) + 1  # 0 past the last line: skipped
            if (offset == 0 or start > 0) and len(d) - start >= 1500:
                texts.append(d[start:])
    if len(texts) < n:
        raise SystemExit(f"--prompts {n}: the held-out documents give only {len(texts)} prompts; use fewer")
    repeat, free = [], []
    for d in texts[:n]:
        passage = d[:900]
        first_line = passage.split("\n", 1)[0][:80] or passage[:80]
        repeat.append(tokenizer.encode(passage + "\n\n" + first_line))
        free.append(tokenizer.encode(d)[:64])
    return {"repeat": repeat, "free": free}


def run(engine, prompts: list[list[int]], batch: int, new_tokens: int, min_seconds: float = 0.0):
    """Generate for ``prompts`` (alone each at batch 1, all together otherwise), again until ``min_seconds`` have
    passed (a run of the copy model at batch 1 takes ~0.1 s, where one stall of the shared machine moves it by
    5%): (tokens, seconds, outputs of the last pass, passes)."""
    from llmc.runtime import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    tokens, seconds, passes = 0, 0.0, 0
    while True:
        passes += 1
        engine.reset_prefix_cache()
        t = time.perf_counter()
        if batch == 1:
            outs = [engine.generate([p], params)[0] for p in prompts]
        else:
            outs = engine.generate(prompts, params)
        seconds += time.perf_counter() - t
        tokens += sum(len(o.token_ids) for o in outs)
        if seconds >= min_seconds:
            return tokens, seconds, [o.token_ids for o in outs], passes


def copy_model(path: Path) -> Path:
    """The copy-trained target, trained by ``scripts/train_default_model.py`` on first use."""
    if not (path / "model.safetensors").exists():
        print(f"training the copy model into {path} (first use; ~2 min)", flush=True)
        subprocess.run([sys.executable, str(REPO / "scripts" / "train_default_model.py"), *COPY_TRAIN_ARGS,
                        "--out", str(path)], check=True)
    return path


def llama_cpp_lookup(models: dict[str, Path], prompts: dict[str, dict[str, list[list[int]]]], args) -> dict:
    """llama.cpp's batch-1 plain and prompt-lookup figures per target and workload, or why there are none."""
    py = PEERS / "venv" / "bin" / "python"
    src = PEERS / "sdist"
    probe = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True) if py.exists() else None
    if probe is None or probe.returncode:
        return {"error": f"not measured: no llama-cpp-python in {py} (benchmarks/peers/setup.sh builds it)"}
    vendored = sorted(src.glob("llama_cpp_python-*/vendor/llama.cpp"))
    env = dict(os.environ, LLAMA_CPP_SRC=str(vendored[-1])) if vendored else dict(os.environ)
    out: dict = {}
    for name, model in models.items():
        gguf = CACHE / "gguf" / f"{name}-f32.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < (model / "model.safetensors").stat().st_mtime:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(py), str(REPO / "benchmarks" / "peers" / "convert_gguf.py"), str(model), str(gguf),
                            "f32"], check=True, env=env, capture_output=True)
        with tempfile.TemporaryDirectory() as tmp:
            pfile, ofile = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
            pfile.write_text(json.dumps(prompts[name]))
            subprocess.run([str(py), str(REPO / "benchmarks" / "peers" / "bench_llamacpp_lookup.py"), "--model",
                            str(gguf), "--prompts", str(pfile), "--out", str(ofile), "--rounds", str(args.rounds),
                            "--new-tokens", str(args.new_tokens), "--num-pred", str(args.num_tokens),
                            "--threads", str(args.threads)], check=True)
            out[name] = json.loads(ofile.read_text())
    return out


def summarize(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "assets" / "default-model")
    ap.add_argument("--copy-model", type=Path, default=CACHE / "copy-model-planted-256",
                    help="the copying target: this checkpoint, trained there on first use (COPY_TRAIN_ARGS)")
    ap.add_argument("--no-copy-model", dest="copy_model", action="store_const", const=None,
                    help="the default model only")
    ap.add_argument("--draft-model", type=Path, default=REPO / "assets" / "default-draft-model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload at batch 1 (batch 8 uses 8)")
    ap.add_argument("--num-tokens", type=int, default=6, help="SpeculativeConfig.num_tokens (most drafts per step)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-seconds", type=float, default=0.5,
                    help="each timed run repeats its prompts until this long (short runs are noisy)")
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                    help="measure llama.cpp's prompt lookup too (needs benchmarks/peers/setup.sh's venv)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    # One spin policy for every engine: under ``auto`` each engine decides at load time from the load it sees
    # then, so that plain and speculative engines could differ in it (1.2-2x either way on these shared cores).
    os.environ.setdefault("LLMC_ORT_SPIN", "0")
    from llmc.runtime import Engine
    from llmc.runtime.speculative.config import SpeculativeConfig

    work = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    models = {"default": args.model}
    if args.copy_model is not None:
        models["copy"] = copy_model(args.copy_model)
    draft = build(args.draft_model, work / "draft")
    configs = {"ngram": SpeculativeConfig("ngram", args.num_tokens),
               "draft": SpeculativeConfig("draft", args.num_tokens, draft_model=draft)}
    # One engine per target, its speculator swapped per method: two engines loaded from the same files ran 2-6%
    # apart here (memory placement; plain against plain, measured at batch 1), as much as what is compared.
    engines, speculators = {}, {}
    for name, model in models.items():
        engines[name] = Engine.load(build(model, work / name), num_threads=args.threads)
        made = {m: engines[name].new_speculator(c, num_threads=args.threads) for m, c in configs.items()}
        speculators[name] = {"plain": None, "control": None, **made}
    tokenizer = engines["default"].tokenizer
    prompts = workloads(tokenizer, max(8, args.prompts))
    plan = [(name, wl) for name in models for wl in prompts]
    # Warm-up: every method runs every group once, untimed. ORT plans its memory per input shape, and a step of
    # a token count it has not seen costs up to 2x (measured: 1.5 vs 0.8 ms, 13 vs 7 ms); verify steps come in
    # many token counts, so without this the first rounds charge speculation a one-time cost plain decode
    # (one token per request) pays in its first few steps.
    for name, wl in plan:
        for batch in (1, 8):
            chosen = prompts[wl][: args.prompts] if batch == 1 else prompts[wl][:8]
            for sp in speculators[name].values():
                engines[name].set_speculator(sp)
                run(engines[name], chosen, batch, args.new_tokens)

    # The engines' objects (tokenizers, graphs) out of the cyclic collector's reach: a full collection over them
    # took 4.5 ms, 5% of a timed run of the copy model, landing in whichever method's run it fell in.
    gc.collect()
    gc.freeze()
    cells: dict[tuple, dict] = {}
    for rnd in range(args.rounds):
        for name, wl in plan:
            for batch in (1, 8):
                chosen = prompts[wl][: args.prompts] if batch == 1 else prompts[wl][:8]
                order = METHODS[rnd % len(METHODS):] + METHODS[: rnd % len(METHODS)]
                got = {}
                for m in order:
                    e = engines[name]
                    e.set_speculator(speculators[name][m])
                    before = e.stats()
                    toks, secs, ids, passes = run(e, chosen, batch, args.new_tokens, args.min_seconds)
                    after = e.stats()
                    got[m] = (toks / secs, ids, after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                              after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                              after.spec_num_verify_steps - before.spec_num_verify_steps,
                              after.num_steps - before.num_steps, passes)
                for m, (rate, ids, drafted, accepted, verifies, steps, passes) in got.items():
                    c = cells.setdefault((name, wl, batch, m), {"tok_s": [], "ratio": [], "drafted": 0,
                                                                "accepted": 0, "verifies": 0, "steps": 0,
                                                                "passes": 0, "identical": True})
                    c["tok_s"].append(rate)
                    c["ratio"].append(rate / got["plain"][0])
                    c["drafted"] += drafted
                    c["accepted"] += accepted
                    c["verifies"] += verifies
                    c["steps"] += steps
                    c["passes"] += passes
                    c["identical"] &= ids == got["plain"][1]
                    c["ids"] = ids
                print(f"round {rnd} {name:7s} {wl:6s} b{batch}  " + "  ".join(
                    f"{m} {got[m][0]:6.1f} ({got[m][0] / got['plain'][0]:.2f}x)" for m in METHODS), flush=True)

    rows = []
    for (name, wl, batch, m), c in cells.items():
        row = {"target": name, "workload": wl, "batch": batch, "method": m,
               "tok_s": summarize(c["tok_s"]), "vs_plain": summarize(c["ratio"]),
               "steps_per_pass": round(c["steps"] / c["passes"], 1),
               "draft_tokens": c["drafted"], "accepted_tokens": c["accepted"],
               "acceptance_rate": round(c["accepted"] / c["drafted"], 3) if c["drafted"] else None,
               "mean_accepted_length": round(c["accepted"] / c["verifies"], 3) if c["verifies"] else None,
               "identical_to_plain": c["identical"]}
        rows.append(row)
    fits = {}
    for name, group in speculators.items():
        for m, sp in group.items():
            if sp is not None:
                fits[f"{name}/{m}"] = {
                    kind: {"fixed_ms": round(a * 1e3, 3), "per_token_ms": round(b * 1e3, 4)}
                    for kind, (a, b) in (("plain", sp.plain_cost.fit()), ("verify_b1", sp.verify_fit(1).fit()),
                                         ("verify_b8", sp.verify_fit(8).fit()))}

    llama = {"error": "not measured: --no-llama-cpp"}
    if args.llama_cpp:
        b1 = {name: {wl: prompts[wl][: args.prompts] for n2, wl in plan if n2 == name} for name in models}
        try:
            llama = llama_cpp_lookup(models, b1, args)
        except subprocess.CalledProcessError as exc:
            llama = {"error": f"not measured: {' '.join(map(str, exc.cmd[:3]))} failed ({exc.returncode})"}
        for name, res in (llama.items() if "error" not in llama else []):
            for wl, methods in res["workloads"].items():
                base = methods["plain"]["tok_s"]
                plain_ids = cells[(name, wl, 1, "plain")]["ids"]
                for m, cell in methods.items():
                    rows.append({"target": name, "workload": wl, "batch": 1, "method": f"llama.cpp {m}",
                                 "tok_s": summarize(cell["tok_s"]),
                                 "vs_plain": summarize([x / y for x, y in zip(cell["tok_s"], base, strict=True)]),
                                 "identical_to_plain": cell["token_ids"] == methods["plain"]["token_ids"],
                                 "same_tokens_as_llmc": sum(a == b for a, b in zip(cell["token_ids"], plain_ids,
                                                                                    strict=True)),
                                 "prompts": len(plain_ids)})
                res["workloads"][wl] = {m: {k: v for k, v in cell.items() if k != "token_ids"}
                                        for m, cell in methods.items()}

    print("\n| target | workload | batch | method | tok/s (median) | vs plain: median (min-max) | acceptance "
          "| mean accepted | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "—" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.2f}"
        mal = "—" if r.get("mean_accepted_length") is None else f"{r['mean_accepted_length']:.2f}"
        v = r["vs_plain"]
        print(f"| {r['target']} | {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']['median']:.0f} | "
              f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f}) | {acc} | {mal} | {r['identical_to_plain']} |")
    result = {
        "benchmark": "bench_speculative", "models": {k: str(v) for k, v in models.items()},
        "copy_train_args": COPY_TRAIN_ARGS, "draft_model": str(args.draft_model.relative_to(REPO)),
        "new_tokens": args.new_tokens, "num_tokens": args.num_tokens, "rounds": args.rounds,
        "min_seconds": args.min_seconds,
        "threads": args.threads, "greedy": True, "ort_spin": os.environ["LLMC_ORT_SPIN"],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "load_avg_at_end": os.getloadavg()},
        "step_cost_fits": fits, "llama_cpp": llama, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
