"""``llmc bench``'s driver: load the engine, run the workloads of a :class:`BenchConfig`, report rows."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from llmc.bench.config import BenchConfig, BenchResult
from llmc.bench.machine import PROBE_SETTLE_S, BandwidthProbe, load_average, measure_read_bandwidth
from llmc.bench.weights import WeightBytes, kv_bytes_per_token, weight_bytes
from llmc.bench.workloads import _greedy, _prompts, _spec_figures, decode_run, prefill_run, request_stream
from llmc.runtime import Engine
from llmc.runtime.speculative.config import SpeculativeConfig


def run(engine_dir: str | Path, config: BenchConfig | None = None,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run the workloads of ``config`` on the engine at ``engine_dir``; returns the table rows.

    Raises :class:`LlmcError` for a bad engine or options, and ``RuntimeError`` if the engine made a
    different number of tokens than requested (a bug).
    """
    cfg = config or BenchConfig()
    say = progress or (lambda msg: None)
    engine_dir = Path(engine_dir)
    cfg.validate()
    engine = _load_engine(engine_dir, cfg)
    cfg.validate(engine.max_model_len, f"{engine_dir / 'hf_config.json'}: ")
    manifest = engine.manifest
    vocab = engine.vocab_size
    wb = weight_bytes(engine_dir, manifest)
    kv_tok = kv_bytes_per_token(manifest)
    say("measuring this machine's read bandwidth")
    probe_buf = np.ones((1 << 28) // 4, dtype=np.float32)

    def probe() -> BandwidthProbe:
        # ORT's workers, when they spin, keep spinning for a while after a run and take the probe's cores:
        # right after a decode workload the probe read 30 GB/s where bw_read read 58 (peers run of
        # 2026-12-03). Let them go to sleep first.
        time.sleep(PROBE_SETTLE_S)
        return measure_read_bandwidth(threads=cfg.threads, buffer=probe_buf)

    start_probe = probe()
    machine = {"read_GBps": start_probe.read_GBps, "probe": asdict(start_probe), "cpu_count": os.cpu_count(),
               "load_avg_start": load_average(), "threads_spin": engine.threads_spin[0],
               "threads_spin_reason": engine.threads_spin[1]}
    result = BenchResult(
        engine=str(engine_dir), config=asdict(cfg),
        model={"model_type": manifest["source"].get("model_type"), "quant": manifest["recipe"].get("quant"),
               "kv_layout": manifest["kv_cache"].get("layout"), "kv_dtype": manifest["kv_cache"].get("dtype"),
               "vocab_size": vocab, "llmc_version": manifest.get("llmc_version")},
        weights=asdict(wb), kv_bytes_per_token=kv_tok, machine=machine)
    engine.generate([[5, 6, 7]], _greedy(4))  # first-run allocations out of every timing

    if "prefill" in cfg.workloads:
        say(f"prefill {cfg.prefill_len} tokens")
        result.rows.append(_prefill_row(engine, cfg))
    if cfg.image is not None:
        from llmc.bench.image import image_row

        say(f"image {cfg.image}: preprocessing, encoder, TTFT with the image ({cfg.input_len}-token prompt)")
        result.rows.append(image_row(engine, Path(cfg.image), cfg.input_len, cfg.repeats, cfg.warmup, cfg.seed,
                                     cfg.threads))
    if "decode" in cfg.workloads:
        for b in cfg.batches:
            say(f"decode batch {b}: {cfg.input_len}-token prompts, {cfg.output_len} new tokens")
            result.rows.append(_decode_row(engine, cfg, b, wb, kv_tok, probe))
    if "stream" in cfg.workloads:
        say(f"request stream: {cfg.stream_requests} requests at {cfg.stream_rate}/s")
        result.rows.append(_stream_row(engine, cfg))
    machine["load_avg_end"] = load_average()
    return result


def _load_engine(engine_dir: Path, cfg: BenchConfig) -> Engine:
    """The engine with a KV pool for the largest workload and prefix caching off: every workload repeats its
    prompts, and a cached prompt would measure a cache lookup instead of a prefill."""
    pool_tokens = max(max(cfg.batches) * (cfg.input_len + cfg.output_len), cfg.prefill_len + 1,
                      cfg.stream_requests * (cfg.input_len + cfg.output_len)) + 64
    spec = SpeculativeConfig.parse(cfg.speculative) if cfg.speculative else None
    return Engine.load(engine_dir, num_threads=cfg.threads, kv_cache_tokens=pool_tokens,
                       max_num_seqs=max(256, max(cfg.batches), cfg.stream_requests), enable_prefix_caching=False,
                       speculative=spec)


def _prefill_row(engine: Engine, cfg: BenchConfig) -> dict:
    prompt = _prompts(engine.vocab_size, 1, cfg.prefill_len, cfg.seed + 7)[0]
    for _ in range(cfg.warmup):
        prefill_run(engine, prompt)
    runs = [prefill_run(engine, prompt) for _ in range(cfg.repeats)]
    return {
        "workload": f"prefill_{cfg.prefill_len}", "batch": 1, "input_len": cfg.prefill_len,
        "tok_s": round(statistics.median(r["tok_s"] for r in runs), 2),
        "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 3),
        "tokens_requested": 1, "tokens_generated": min(r["tokens"] for r in runs),
        "runs_tok_s": [round(r["tok_s"], 2) for r in runs]}


def _decode_row(engine: Engine, cfg: BenchConfig, b: int, wb: WeightBytes, kv_tok: int,
                probe: Callable[[], BandwidthProbe]) -> dict:
    """Decode of ``b`` prompts together, against the machine's read bandwidth probed just before and after."""
    prompts = _prompts(engine.vocab_size, b, cfg.input_len, cfg.seed + 100 + b)
    for _ in range(cfg.warmup):  # same shapes, fewer tokens: warms ORT's allocations for this batch
        decode_run(engine, prompts, min(cfg.output_len, 8))
    before = probe()
    s0 = engine.stats()
    runs = [decode_run(engine, prompts, cfg.output_len) for _ in range(cfg.repeats)]
    s1 = engine.stats()
    after = probe()
    for r in runs:
        if r["tokens"] != b * cfg.output_len:
            raise RuntimeError(f"decode batch {b}: the engine made {r['tokens']} tokens, not the "
                               f"{b * cfg.output_len} requested (a bug: please report it)")
    tok_s = statistics.median(r["tok_s"] for r in runs)
    bandwidth = (before.read_GBps + after.read_GBps) / 2
    # One step reads the streamed weights once, each sequence's embedding row and its KV
    # (mean context over the timed steps: input_len + 1 .. input_len + output_len - 1).
    mean_ctx = cfg.input_len + cfg.output_len / 2
    step_bytes = wb.streamed + b * (wb.row + kv_tok * mean_ctx)
    per_token = step_bytes / b
    achieved = per_token * tok_s / 1e9
    return {
        "workload": f"decode_b{b}", "batch": b, "input_len": cfg.input_len, "output_len": cfg.output_len,
        "tok_s": round(tok_s, 2), "ms_per_step": round(1000 * b / tok_s, 3),
        "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 3),
        "tokens_requested": b * cfg.output_len, "tokens_generated": min(r["tokens"] for r in runs),
        "bytes_per_token": int(per_token), "achieved_GBps": round(achieved, 3),
        "machine_read_GBps": round(bandwidth, 2), "machine_read_GBps_before_after": [
            before.read_GBps, after.read_GBps],
        "roofline_fraction": round(achieved / bandwidth, 4),
        "roofline_tok_s": round(bandwidth * 1e9 / per_token, 1),
        "runs_tok_s": [round(r["tok_s"], 2) for r in runs], **_spec_figures(s0, s1)}


def _stream_row(engine: Engine, cfg: BenchConfig) -> dict:
    prompts = _prompts(engine.vocab_size, cfg.stream_requests, cfg.input_len, cfg.seed + 1)
    stream = request_stream(engine, prompts, cfg.output_len, cfg.stream_rate, cfg.seed)
    requested = cfg.stream_requests * cfg.output_len
    if stream["tokens"] != requested:
        raise RuntimeError(f"request stream: the engine made {stream['tokens']} tokens, not the {requested} "
                           "requested (a bug: please report it)")
    return {"workload": "stream", "input_len": cfg.input_len, "output_len": cfg.output_len,
            "tokens_requested": requested, "tokens_generated": stream.pop("tokens"), **stream}
