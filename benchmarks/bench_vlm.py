#!/usr/bin/env python3
"""A vision-language checkpoint on the CPU, int4: llmc beside llama.cpp's multimodal path (libmtmd), one run.

The checkpoint is ``benchmarks/peers/make_model.py gemma3-4b-vl`` (Gemma3ForConditionalGeneration at Gemma 3 4B's
geometry, 6 text layers, the whole 27-layer SigLIP so400m encoder at 896 px, random bfloat16 weights). This script
makes what is missing (each command printed; the llmc build goes through llmc's build cache):

- llmc:      ``llmc build MODEL --target cpu --quant int4 --kv-cache-dtype fp16 --eval-tokens 256``
             (RTN int4, group 128; the LM head int8, llmc's default; the encoder graph float32, the compute dtype)
- llama.cpp: ``convert_hf_to_gguf.py`` (via peers/convert_gguf.py) text f16 -> ``llama-quantize`` Q4_0, and
             ``--mmproj`` for the encoder + projector (f16 by default, ``--mmproj-type``)

then runs interleaved rounds (the order swapping each round), each with a fresh 896x896 image (so no engine has it
cached) and the same thread count:

- llmc (in this process, ``Engine.load(num_threads=T)``): the image processor and the encoder graph alone; a prompt
  with the image, N new tokens through ``Engine.stream`` (TTFT = wall clock from the call to the first token, so
  it includes preprocessing and the encoder: the engine's image cache is cleared first; GenerationOutput.ttft would
  not, as the encoder runs in ``submit``, before the request's arrival time); the same engine with a text-only
  prompt of the same total length, N new tokens.
- llama.cpp: ``llama-mtmd-cli -m Q4_0 --mmproj MMPROJ --image IMG -p TEXT -n N --ignore-eos --temp 0 -t T -tb T``;
  its log (-v) gives the encoder time ("mtmd batch encoding done in"), the image's decode into the KV cache, and
  llama_perf's prompt eval and eval (decode) times. TTFT = llama_perf's prompt eval time, which runs from the first
  text chunk's llama_decode to the first token's logits and so holds the encoder, the image's decode and the text
  (the image file's decode and preprocessing happen before it: left out, in llama.cpp's favour). Text decode:
  ``llama-bench -p 0 -n N -d P`` at the same depth.

decode tok/s = (N - 1) / (time of token N - time of token 1) on both sides (llama_perf's eval runs / eval time).
Ratios are per round (llama.cpp / llmc for times, llmc / llama.cpp for rates), then the median over rounds.

usage: bench_vlm.py [--shape gemma3-4b-vl] [--rounds 3] [--new-tokens 64] [--threads 2] [--mmproj-type f16]
       [--no-llamacpp]
env:   PEERS_ROOT (model, GGUF files and the llama.cpp build: $PEERS_ROOT/llama-build/bin), LLMC_CACHE_DIR
Writes benchmarks/results/bench_vlm_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("PEERS_ROOT", os.path.expanduser("~/.cache/llmc-peers")))
BIN = ROOT / "llama-build" / "bin"
PROMPT = "Describe this image in detail, with every object you can see and where it is."


def sh(cmd: list[str], log: Path, env: dict | None = None) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    t = time.time()
    with open(log, "a") as f:
        subprocess.run(list(map(str, cmd)), check=True, stdout=f, stderr=subprocess.STDOUT, env=env)
    print(f"  ({time.time() - t:.0f} s)", flush=True)


def prepare(shape: str, mmproj_type: str, llamacpp: bool) -> dict:
    """The llmc engine and the GGUF files, made where missing."""
    hf = ROOT / f"model-{shape}"
    work = ROOT / shape
    work.mkdir(parents=True, exist_ok=True)
    log = work / "prepare.log"
    py = sys.executable
    if not (hf / "config.json").exists():
        sh([py, HERE / "peers" / "make_model.py", shape], log)
    engine = work / "llmc-int4"
    if not (engine / "manifest.json").exists():
        env = dict(os.environ, LLMC_CACHE_DIR=os.environ.get("LLMC_CACHE_DIR", str(ROOT / "llmc-cache")))
        sh([py, "-m", "llmc.cli.main", "build", hf, "--target", "cpu", "--quant", "int4", "--kv-cache-dtype", "fp16",
            "--eval-tokens", "256", "-o", engine, "--force", "-q"], log, env)
    paths = {"model": str(hf), "llmc_engine": str(engine)}
    if llamacpp:
        gg = work / "gguf"
        gg.mkdir(exist_ok=True)
        conv = HERE / "peers" / "convert_gguf.py"
        text16, text4, mm = gg / "text-f16.gguf", gg / "text-q4_0.gguf", gg / f"mmproj-{mmproj_type}.gguf"
        if not text4.exists():
            if not text16.exists():
                sh([py, conv, hf, text16, "f16"], log)
            sh([BIN / "llama-quantize", text16, text4, "Q4_0", "2"], log)
        if not mm.exists():
            sh([py, conv, hf, mm, mmproj_type, "--mmproj"], log)
        paths.update(gguf_text=str(text4), gguf_mmproj=str(mm))
    return paths


def write_image(path: Path, seed: int) -> bytes:
    from llmc.testing.vlm import random_image

    data = random_image(np.random.default_rng(seed), (896, 896))
    path.write_bytes(data)
    return data


class Llmc:
    def __init__(self, engine_dir: str, threads: int, new_tokens: int):
        from llmc.runtime import Engine, SamplingParams
        from llmc.runtime.tokenizer import Tokenizer

        t = time.perf_counter()
        self.engine = Engine.load(engine_dir, num_threads=threads)
        self.load_s = time.perf_counter() - t
        self.inputs = self.engine.images
        self.inputs.threads = threads  # the encoder session (opened on the first image) gets the same threads
        tok = Tokenizer(Path(engine_dir))
        # the text llama-mtmd-cli sends (the checkpoint's chat template: "user: <image>TEXT\nmodel: ")
        self.prompt = [*tok.encode("user: "), self.inputs.placeholder,
                       *tok.encode(PROMPT + "\nmodel: ", add_special_tokens=False)]
        self.params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        self.encoder = self.engine.graph(self.inputs.graph_name, threads)
        self.new_tokens = new_tokens

    def encoder_alone(self, image: bytes) -> dict:
        from llmc.runtime.vision import decode_image

        t0 = time.perf_counter()
        pixels = np.ascontiguousarray(self.inputs.processor([decode_image(image)]).pixel_values, dtype=np.float32)
        t1 = time.perf_counter()
        self.encoder.run({self.encoder.inputs[0]: pixels})
        t2 = time.perf_counter()
        return {"preprocess_ms": 1000 * (t1 - t0), "encoder_ms": 1000 * (t2 - t1)}

    def _timed(self, prompt: list[int], images=None) -> dict:
        """Wall-clock times of one request through ``Engine.stream``: TTFT from the call (GenerationOutput.ttft
        starts at the request's arrival, after ``submit`` has run the image processor and the encoder), and
        decode tok/s = (N - 1) / (t_N - t_1) from the tokens' arrival times."""
        stamps = []
        t0 = time.perf_counter()
        for ev in self.engine.stream([prompt], self.params, images=images):
            if ev.token_id is not None:
                stamps.append(time.perf_counter())
        assert len(stamps) == self.new_tokens, len(stamps)
        return {"ttft_ms": 1000 * (stamps[0] - t0), "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0])}

    def with_image(self, image: bytes) -> dict:
        self.inputs._cache.clear()  # cold: the encoder runs inside this request
        encoded = self.inputs.encoded
        row = self._timed(self.prompt, [[image]])
        assert self.inputs.encoded == encoded + 1
        layout = self.inputs.prefix + self.inputs.suffix
        self.prompt_tokens = len(self.prompt) - 1 + len(layout) + self.inputs.tokens_per_image
        return {**row, "prompt_tokens": self.prompt_tokens}

    def text_only(self, n: int, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        ids = [2, *rng.integers(4, 8000, n - 1).tolist()]  # BPE tokens of the checkpoint's tokenizer
        return {**self._timed(ids), "prompt_tokens": n}


def _grab(pattern: str, text: str, what: str, cast=float):
    m = re.findall(pattern, text)
    if not m:
        raise SystemExit(f"llama-mtmd-cli: no {what} in its log (pattern {pattern!r}); log tail:\n{text[-3000:]}")
    return m


def llamacpp_image(paths: dict, image: Path, threads: int, new_tokens: int) -> dict:
    cmd = [BIN / "llama-mtmd-cli", "-m", paths["gguf_text"], "--mmproj", paths["gguf_mmproj"], "--image", image,
           "-p", PROMPT, "-n", new_tokens, "--ignore-eos", "--temp", "0", "-t", threads, "-tb", threads,
           "-c", 4096, "--no-mmproj-offload", "--jinja", "-v"]  # -v: without it the timings are not logged
    t = time.perf_counter()
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    wall = time.perf_counter() - t
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"llama-mtmd-cli failed ({r.returncode}): {' '.join(map(str, cmd))}\n{log[-3000:]}")
    enc = sum(float(x) for x in _grab(r"mtmd batch encoding done in (\d+) ms", log, "encode time"))
    img_dec = sum(float(x) for x in _grab(r"image decoded \(batch \d+/\d+\) in (\d+) ms", log, "image decode"))
    pe = _grab(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log, "prompt eval")[-1]
    ev = _grab(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log, "eval")[-1]
    p_ms, p_tok, e_ms, e_runs = float(pe[0]), int(pe[1]), float(ev[0]), int(ev[1])
    # llama_perf's prompt eval runs from the first llama_decode (the text before the image) to the first token's
    # logits: the encoder runs inside it (the text chunk's compute is synchronised only at the image's decode)
    ttft = p_ms if p_ms >= enc + img_dec else enc + p_ms
    return {"encoder_ms": enc, "image_decode_ms": img_dec, "prompt_eval_ms": p_ms, "prompt_tokens": p_tok,
            "ttft_ms": ttft, "ttft_from": "prompt_eval" if ttft == p_ms else "encode+prompt_eval",
            "decode_tps": 1000 * e_runs / e_ms, "decode_runs": e_runs, "wall_s": wall,
            "command": " ".join(map(str, cmd))}


def llamacpp_text(paths: dict, depth: int, threads: int, new_tokens: int) -> dict:
    cmd = [BIN / "llama-bench", "-m", paths["gguf_text"], "-p", 0, "-n", new_tokens, "-d", depth, "-t", threads,
           "-r", 1, "-o", "json"]
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed: {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    row = json.loads(r.stdout)[0]
    return {"decode_tps": float(row["avg_ts"]), "depth": depth, "command": " ".join(map(str, cmd))}


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gemma3-4b-vl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mmproj-type", default="f16", choices=("f16", "f32", "bf16"))
    ap.add_argument("--no-llamacpp", action="store_true", help="llmc only (llama.cpp not built or refused)")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llamacpp = not args.no_llamacpp
    paths = prepare(args.shape, args.mmproj_type, llamacpp)
    if args.prepare_only:
        return
    img_dir = ROOT / args.shape / "images"
    img_dir.mkdir(exist_ok=True)

    llmc = Llmc(paths["llmc_engine"], args.threads, args.new_tokens)
    print(f"llmc engine loaded in {llmc.load_s:.1f} s; warm-up (one image, one text prompt)", flush=True)
    warm = write_image(img_dir / "warmup.png", 999)
    llmc.encoder_alone(warm)
    llmc.with_image(warm)
    llmc.text_only(llmc.prompt_tokens, 999)

    rounds = []
    for r in range(args.rounds):
        img_path = img_dir / f"round{r}.png"
        image = write_image(img_path, r)
        row: dict = {"round": r, "loadavg_start": os.getloadavg()}
        order = ["llmc", "llama.cpp"] if r % 2 == 0 or not llamacpp else ["llama.cpp", "llmc"]
        for who in order:
            if who == "llmc":
                enc = llmc.encoder_alone(write_image(img_dir / f"round{r}_enc.png", 1000 + r))
                img = llmc.with_image(image)
                txt = llmc.text_only(img["prompt_tokens"], r)
                row["llmc"] = {**enc, "ttft_image_ms": img["ttft_ms"], "decode_image_tps": img["decode_tps"],
                               "prompt_tokens": img["prompt_tokens"], "ttft_text_ms": txt["ttft_ms"],
                               "decode_text_tps": txt["decode_tps"]}
            elif llamacpp:
                row["llama.cpp"] = llamacpp_image(paths, img_path, args.threads, args.new_tokens)
                row["llama.cpp"]["decode_text"] = llamacpp_text(paths, row["llama.cpp"]["prompt_tokens"],
                                                                args.threads, args.new_tokens)
        row["loadavg_end"] = os.getloadavg()
        rounds.append(row)
        print(json.dumps(row, default=str), flush=True)

    def med(xs):
        return round(statistics.median(xs), 3)

    L = {k: med([r["llmc"][k] for r in rounds]) for k in rounds[0]["llmc"]}
    summary: dict = {"llmc": L}
    if llamacpp:
        C = {k: med([r["llama.cpp"][k] for r in rounds]) for k in
             ("encoder_ms", "image_decode_ms", "prompt_eval_ms", "prompt_tokens", "ttft_ms", "decode_tps")}
        C["decode_text_tps"] = med([r["llama.cpp"]["decode_text"]["decode_tps"] for r in rounds])
        summary["llama.cpp"] = C
        per = {
            "ttft_image_llamacpp_over_llmc": [r["llama.cpp"]["ttft_ms"] / r["llmc"]["ttft_image_ms"] for r in rounds],
            "encoder_llamacpp_over_llmc_graph": [r["llama.cpp"]["encoder_ms"] / r["llmc"]["encoder_ms"]
                                                 for r in rounds],
            "decode_image_llmc_over_llamacpp": [r["llmc"]["decode_image_tps"] / r["llama.cpp"]["decode_tps"]
                                                for r in rounds],
            "decode_text_llmc_over_llamacpp": [r["llmc"]["decode_text_tps"] / r["llama.cpp"]["decode_text"]
                                               ["decode_tps"] for r in rounds],
        }
    else:
        per = {}
    per["llmc_decode_image_over_text"] = [r["llmc"]["decode_image_tps"] / r["llmc"]["decode_text_tps"]
                                          for r in rounds]
    ratios = {k: {"median": med(v), "min": round(min(v), 3), "max": round(max(v), 3)} for k, v in per.items()}

    rows = [("TTFT, one 896x896 image (ms)", L["ttft_image_ms"], "ttft_ms", "ttft_image_llamacpp_over_llmc"),
            ("  encoder (ms; llmc: graph alone)", L["encoder_ms"], "encoder_ms", "encoder_llamacpp_over_llmc_graph"),
            ("  llmc preprocessing (ms)", L["preprocess_ms"], None, None),
            ("decode after the image (tok/s)", L["decode_image_tps"], "decode_tps", "decode_image_llmc_over_llamacpp"),
            ("decode, text-only prompt (tok/s)", L["decode_text_tps"], "decode_text_tps",
             "decode_text_llmc_over_llamacpp"),
            ("TTFT, text-only prompt, same length (ms)", L["ttft_text_ms"], None, None)]
    print(f"\n{args.shape}, int4, {args.threads} threads, {args.rounds} rounds, {cpu_model()} "
          f"(medians; ratio = llmc's advantage, per round, median [min..max])")
    print(f"{'':44s} {'llmc':>10s} {'llama.cpp':>10s} {'ratio':>24s}")
    for label, lv, ck, rk in rows:
        cv = summary.get("llama.cpp", {}).get(ck) if ck else None
        rt = ratios.get(rk) if rk else None
        rs = f"{rt['median']:.2f}x [{rt['min']:.2f}..{rt['max']:.2f}]" if rt else ""
        print(f"{label:44s} {lv:10.1f} {'' if cv is None else f'{cv:10.1f}':>10s} {rs:>24s}")
    q = ratios["llmc_decode_image_over_text"]
    print(f"llmc decode after the image / after a text-only prompt: {q['median']:.3f} [{q['min']:.3f}..{q['max']:.3f}]")
    if llamacpp:
        print(f"prompt tokens: llmc {L['prompt_tokens']:.0f}, llama.cpp {summary['llama.cpp']['prompt_tokens']:.0f}")

    manifest = json.loads((Path(paths["llmc_engine"]) / "manifest.json").read_text())
    llmc_rev = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    llama_rev = subprocess.run(["git", "-C", str(ROOT / "llama.cpp"), "log", "-1", "--format=%h"],
                               capture_output=True, text=True).stdout.strip()
    result = {
        "shape": args.shape, "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
        "cpu_model": cpu_model(), "nproc": os.cpu_count(), "llmc_commit": llmc_rev, "llama_cpp_commit": llama_rev,
        "paths": paths, "mmproj_type": args.mmproj_type if llamacpp else None,
        "llmc_recipe": {"compute_dtype": manifest["recipe"].get("compute_dtype"),
                        **(manifest["recipe"].get("quant") or {})},
        "llmc_load_s": round(llmc.load_s, 2),
        "llmc_prompt": "ids: BOS 'user: ' <start_of_image> f'{PROMPT}\\nmodel: ' (llmc adds the image's blank "
                       "lines, 256 soft tokens and <end_of_image>)",
        "llamacpp_prompt": PROMPT, "summary": summary, "ratios": ratios, "rounds_detail": rounds,
        "llamacpp_available": llamacpp,
    }
    out = Path(args.out) if args.out else HERE / "results" / f"bench_vlm_{args.shape}.json"
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
