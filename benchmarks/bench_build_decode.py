"""Build time, peak build RSS, and batch-1 decode tok/s: llmc CPU engine next to transformers eager.

Both are measured in one run on the same checkpoint, so the ratio is meaningful even though this
machine's memory bandwidth drifts. Decode rate follows ../shared/peers: a 128-token prompt,
N = 128 new tokens, rate = (N - 1) / (t_N - t_1), median of --repeats runs after a warm-up.

    python benchmarks/bench_build_decode.py [--model assets/default-model] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def build_in_subprocess(model: Path, out: Path) -> tuple[float, float]:
    """Build with the real CLI in a child process; returns (seconds, peak RSS of the child in MiB)."""
    code = (
        "import sys; from llmc.cli.main import main; "
        f"sys.argv = ['llmc', 'build', {str(model)!r}, '-o', {str(out)!r}, '--force', '-q']; main()"
    )
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    seconds = time.perf_counter() - t
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, peak_kib / 1024


def llmc_decode(engine_dir: Path, prompt: list[int], n: int, threads: int) -> float:
    from llmc.runtime import Engine, SamplingParams

    engine = Engine.load(engine_dir, num_threads=threads)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up
    rates = []
    for _ in range(ARGS.repeats):
        out = engine.generate([prompt], params)[0]
        rates.append((n - 1) / (out.latency - out.ttft))
    return statistics.median(rates)


def hf_decode(model_dir: Path, prompt: list[int], n: int, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    def gen(k: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        return time.perf_counter() - t

    gen(n)  # warm-up
    rates = []
    for _ in range(ARGS.repeats):
        t1, tn = gen(1), gen(n)
        rates.append((n - 1) / (tn - t1))
    return statistics.median(rates)


def main() -> None:
    model = Path(ARGS.model).resolve()
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    prompt = np.random.default_rng(0).integers(4, vocab, ARGS.prompt_len).tolist()
    weights_mib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        build_s, build_rss = build_in_subprocess(model, engine_dir)
        llmc_tps = llmc_decode(engine_dir, prompt, ARGS.new_tokens, ARGS.threads)
    hf_tps = hf_decode(model, prompt, ARGS.new_tokens, ARGS.threads)
    rows = {
        "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
        "weights_mib": round(weights_mib, 1),
        "build_s": round(build_s, 2),
        "build_peak_rss_mib": round(build_rss, 1),
        "llmc_decode_b1_tok_s": round(llmc_tps, 1),
        "transformers_decode_b1_tok_s": round(hf_tps, 1),
        "ratio_llmc_over_transformers": round(llmc_tps / hf_tps, 2),
        "threads": ARGS.threads,
        "prompt_len": ARGS.prompt_len,
        "new_tokens": ARGS.new_tokens,
        "machine": platform.machine(),
    }
    print(f"{'metric':34} value")
    for k, v in rows.items():
        print(f"{k:34} {v}")
    out = REPO / "benchmarks" / "results" / "bench_build_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "assets" / "default-model"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    ARGS = parser.parse_args()
    main()
