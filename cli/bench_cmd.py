"""``llmc bench ENGINE``: prefill, batched decode and a request stream on one engine, with a roofline.

Thin: parses flags into :class:`llmc.bench.config.BenchConfig`, runs :func:`llmc.bench.driver.run`,
prints a table (or JSON) and optionally saves the JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from llmc.errors import LlmcError


def _int_list(flag: str, values: tuple[str, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for part in v.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise LlmcError(f"{flag} {v!r}: {part!r} is not a whole number; e.g. {flag} 1,8,32") from None
    return tuple(out)


def _workloads(value: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in value.split(",") if w.strip())


def format_table(result: dict) -> str:
    """The human-readable table of a :class:`~llmc.bench.config.BenchResult` (as a dict)."""
    w, m = result["weights"], result["machine"]
    lines = [f"engine {result['engine']}  ({result['model'].get('quant')}, {result['config']['threads']} threads)",
             f"weights read per step {w['streamed'] / 1e6:.1f} MB (+ {w['row']} B of embedding rows per token), "
             f"weight files {w['files'] / 1e6:.1f} MB, KV {result['kv_bytes_per_token']} B per token of context",
             f"machine read bandwidth {m['read_GBps']:.1f} GB/s ({m['probe']['method']}); "
             f"load average {m.get('load_avg_start')}; ORT threads "
             f"{'spin' if m.get('threads_spin') else 'sleep'} between ops ({m.get('threads_spin_reason', '?')})", ""]
    head = f"{'workload':14} {'tok/s':>10} {'ms/step':>9} {'TTFT ms':>9} {'GB/s':>8} {'of bw':>7}  tokens"
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        if r["workload"] in ("stream", "image"):
            continue
        frac = f"{100 * r['roofline_fraction']:6.1f}%" if "roofline_fraction" in r else f"{'-':>7}"
        gbps = f"{r['achieved_GBps']:8.2f}" if "achieved_GBps" in r else f"{'-':>8}"
        step = f"{r['ms_per_step']:9.2f}" if "ms_per_step" in r else f"{'-':>9}"
        lines.append(f"{r['workload']:14} {r['tok_s']:10.1f} {step} {r['ttft_ms']:9.1f} {gbps} {frac}  "
                     f"{r['tokens_generated']}/{r['tokens_requested']}")
        if "spec_acceptance_rate" in r:
            lines.append(f"{'':14} speculative ({result['config'].get('speculative')}): acceptance "
                         f"{100 * r['spec_acceptance_rate']:.1f}% of {r['spec_draft_tokens']} drafts, mean accepted "
                         f"length {r['spec_mean_accepted_length']:.2f}")
    for r in result["rows"]:
        if r["workload"] == "stream":
            lines += ["", f"request stream: {r['requests']} requests at {r['rate_per_s']}/s, {r['input_len']} in / "
                          f"{r['output_len']} out: {r['tok_s']:.1f} tok/s; TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                          f"p99 {r['ttft_p99_ms']:.1f} ms; inter-token p50 {r['itl_p50_ms']:.2f} ms, "
                          f"p99 {r['itl_p99_ms']:.2f} ms"]
    for r in result["rows"]:
        if r["workload"] == "image":
            h, w = r["image_hw"]
            lines += ["", f"image {r['image']} ({w}x{h}, {r['image_tokens']} tokens): preprocessing "
                          f"{r['preprocess_ms']:.1f} ms, encoder {r['encoder_ms']:.1f} ms; TTFT of a "
                          f"{r['input_len']}-token prompt with it {r['ttft_ms']:.1f} ms (encoder included), "
                          f"without it {r['ttft_text_only_ms']:.1f} ms"]
    lines.append("")
    lines.append("of bw = (weights streamed once per step + each sequence's KV and embedding row) per token "
                 "x tok/s / machine read bandwidth")
    return "\n".join(lines)


@click.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--workloads", default="prefill,decode,stream", show_default=True,
              help="Comma-separated: prefill (one --prefill-len prompt), decode (each --batch), stream "
                   "(Poisson request arrivals: TTFT and inter-token latency p50/p99).")
@click.option("-b", "--batch", "batches", multiple=True, default=("1,8,32",), show_default=True,
              help="Decode batch sizes (comma-separated or repeated).")
@click.option("--input-len", default=128, show_default=True, help="Prompt tokens per decode/stream request.")
@click.option("--output-len", default=128, show_default=True, help="New tokens per request (EOS never stops them).")
@click.option("--prefill-len", default=512, show_default=True, help="Prompt tokens of the prefill workload.")
@click.option("--repeats", default=3, show_default=True, help="Timed runs per workload (the median is reported).")
@click.option("--warmup", default=1, show_default=True, help="Untimed runs before each workload.")
@click.option("--threads", default=None, type=int, help="ONNX Runtime threads [default: all cores].")
@click.option("--stream-requests", default=16, show_default=True, help="Requests in the request-stream workload.")
@click.option("--stream-rate", default=4.0, show_default=True, help="Request arrivals per second (Poisson).")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompts and arrival times.")
@click.option("--speculative", default=None, metavar="ngram|draft:PATH",
              help="Speculative decoding: prompt lookup, or a draft engine at PATH (acceptance in the table).")
@click.option("--image", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="PATH",
              help="Vision-language engines: also time this image's preprocessing, the encoder, and time to first "
                   "token of an --input-len prompt with it (encoder included) and without it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), default=None,
              help="Also save the JSON to this file (parent directories are created).")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
def bench(engine: Path, workloads: str, batches: tuple[str, ...], input_len: int, output_len: int, prefill_len: int,
          repeats: int, warmup: int, threads: int | None, stream_requests: int, stream_rate: float, seed: int,
          speculative: str | None, as_json: bool, out: Path | None, quiet: bool, image: Path | None = None) -> None:
    """Benchmark an ENGINE: prefill, decode at each batch size, a request stream; report tok/s and the
    achieved memory bandwidth as a fraction of this machine's measured read bandwidth.

    \b
      llmc bench engines/m                                   # everything, 3 repeats
      llmc bench engines/m --batch 8 --input-len 128 --output-len 128 --workloads decode
      llmc bench engines/m --json --out results/m.json
    """
    import os

    from llmc.bench.config import BenchConfig
    from llmc.bench.driver import run

    if out is not None and out.is_dir():
        raise LlmcError(f"--out {out}: is a directory; give a file name, e.g. --out {out / 'bench.json'}")
    cfg = BenchConfig(workloads=_workloads(workloads), batches=_int_list("--batch", batches), input_len=input_len,
                      output_len=output_len, prefill_len=prefill_len, repeats=repeats, warmup=warmup,
                      threads=threads if threads is not None else (os.cpu_count() or 1),
                      stream_requests=stream_requests, stream_rate=stream_rate, seed=seed, speculative=speculative,
                      image=str(image) if image is not None else None)
    cfg.validate()
    start = time.perf_counter()

    def progress(msg: str) -> None:
        if not quiet:
            click.echo(f"{msg} (+{time.perf_counter() - start:.1f}s)", err=True)

    result = run(engine, cfg, progress=progress).as_dict()
    result["wall_s"] = round(time.perf_counter() - start, 2)
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1) + "\n")
        except OSError as exc:
            raise LlmcError(f"--out {out}: cannot write ({exc.strerror}); choose a writable path") from None
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(format_table(result))
