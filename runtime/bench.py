"""``llmc bench``: the standard workloads on one engine, with a roofline report.

Definitions match benchmarks/peers (so figures compare with llama.cpp and ONNX Runtime GenAI):

- prefill tok/s = P / TTFT for one P-token prompt (P = 512 by default);
- decode bB tok/s = B * (N - 1) / (t_N - t_1) for B different prompts of ``input_len`` tokens decoded
  together, N = ``output_len`` new tokens each, t_i = when token i of the batch became available (the
  prompt pass is excluded);
- a request stream: requests with Poisson arrivals; TTFT and inter-token latency p50/p99.

Each figure is the median of ``repeats`` timed runs after ``warmup`` untimed ones. Greedy decoding;
EOS never stops generation, so every request makes exactly the tokens it asked for (checked).

Roofline. A decode step reads every weight that a matrix op consumes once, the embedding rows of its
tokens, and the KV cache of every sequence. Those bytes come from the engine's own graph (each
initializer and the ops that consume it, read from ``model.onnx`` without the onnx package, which the
runtime does not depend on) and its manifest (KV layout). Bytes per token / time per token is the
achieved read bandwidth, reported against this machine's read bandwidth measured right before and
after each decode workload (it drifts minute to minute on shared machines).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.sampler import SamplingParams

WORKLOADS = ("prefill", "decode", "stream")
PROBE_SETTLE_S = 0.25  # idle time before each bandwidth probe (see run())

# Ops whose weight input is read by row (embedding lookups), not streamed whole every step.
_GATHER_OPS = {"Gather", "GatherND", "GatherElements", "GatherBlockQuantized"}

# ONNX TensorProto.DataType -> bits per element.
_DTYPE_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 16: 16,
               17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}


@dataclass
class BenchConfig:
    """What ``llmc bench`` runs. Lengths in tokens; ``stream_rate`` in requests per second."""

    workloads: tuple[str, ...] = WORKLOADS
    batches: tuple[int, ...] = (1, 8, 32)
    input_len: int = 128
    output_len: int = 128
    prefill_len: int = 512
    repeats: int = 3
    warmup: int = 1
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    stream_requests: int = 16
    stream_rate: float = 4.0
    seed: int = 0
    speculative: str | None = None  # "ngram" or "draft:PATH": speculative decoding (SpeculativeConfig.parse)

    def validate(self, max_model_len: int | None = None, source: str = "") -> None:
        """Raise :class:`LlmcError` naming the flag, the constraint and the fix."""
        if self.speculative:
            from llmc.runtime.speculative import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative)  # raises naming --speculative
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise LlmcError(f"--workloads: unknown workload {bad[0] if bad else '(none)'!r}; choose from "
                            f"{', '.join(WORKLOADS)} (comma-separated)")
        for flag, value, low in (("--input-len", self.input_len, 1), ("--output-len", self.output_len, 2),
                                 ("--prefill-len", self.prefill_len, 1), ("--repeats", self.repeats, 1),
                                 ("--warmup", self.warmup, 0), ("--threads", self.threads, 1),
                                 ("--stream-requests", self.stream_requests, 1)):
            if value < low:
                why = " (decode is timed between the first and the last new token)" if flag == "--output-len" else ""
                raise LlmcError(f"{flag} {value}: must be at least {low}{why}")
        if not self.batches or min(self.batches) < 1:
            raise LlmcError(f"--batch {','.join(map(str, self.batches)) or '(none)'}: every batch size must be "
                            "at least 1, e.g. --batch 1,8,32")
        if self.stream_rate <= 0:
            raise LlmcError(f"--stream-rate {self.stream_rate}: must be positive (requests per second)")
        if max_model_len:
            need = {"--input-len + --output-len": self.input_len + self.output_len}
            if "prefill" in self.workloads:
                need["--prefill-len + 1"] = self.prefill_len + 1
            for what, n in need.items():
                if n > max_model_len:
                    raise LlmcError(f"{what} = {n} tokens exceeds the engine's context of {max_model_len} tokens "
                                    f"({source}max_position_embeddings); lower them")


@dataclass
class WeightBytes:
    """Bytes of an engine's weights, from its graph. ``streamed`` is read once per forward step (every
    initializer a non-gather op consumes); ``gathered`` are embedding tables, of which a step reads
    ``row`` bytes per token; ``files`` is the size of the weight files on disk."""

    streamed: int
    gathered: int
    row: int
    files: int
    initializers: int


@dataclass
class BandwidthProbe:
    """This machine's read bandwidth in GB/s (1e9 bytes/s): ``threads`` threads each take the maximum of
    their share of a ``nbytes`` float32 array; ``read_GBps`` is the median of ``samples``."""

    read_GBps: float
    samples: list[float]
    nbytes: int
    threads: int
    method: str = "C++ OpenMP stream of float32 sums, one slice per thread"


@dataclass
class BenchResult:
    engine: str
    config: dict
    model: dict
    weights: dict
    kv_bytes_per_token: int
    machine: dict
    rows: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# -- the machine ----------------------------------------------------------------------------------

def measure_read_bandwidth(nbytes: int = 1 << 28, repeats: int = 9, threads: int = 1,
                           buffer: np.ndarray | None = None) -> BandwidthProbe:
    """Read bandwidth in GB/s of a float32 array of ``nbytes`` (8x this machine's L3): ``threads`` threads
    each stream their own slice; median of ``repeats`` after one untimed pass. Pass ``buffer`` to reuse an
    array across probes. The probe is C++ (llmc.runtime._membench, the method of benchmarks/peers/bw_read.c):
    a numpy reduction from Python threads read ~0.85x of that C loop here."""
    from llmc.runtime import _membench

    a = buffer if buffer is not None else np.ones(nbytes // 4, dtype=np.float32)
    samples = list(_membench.read_bandwidth(a, repeats, threads))
    return BandwidthProbe(round(statistics.median(samples), 2), [round(s, 2) for s in samples], a.nbytes, threads)


def load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages (how busy the machine was), where the OS reports them."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- the engine's bytes ---------------------------------------------------------------------------

def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: memoryview, start: int, end: int):
    """Protocol-buffer fields in ``buf[start:end]``: (number, wire type, value or (start, end) span)."""
    i = start
    while i < end:
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield num, wire, value
        elif wire == 2:
            n, i = _varint(buf, i)
            yield num, wire, (i, i + n)
            i += n
        elif wire == 1:
            yield num, wire, None
            i += 8
        elif wire == 5:
            yield num, wire, None
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _tensor_bytes(buf: memoryview, span: tuple[int, int]) -> tuple[str, int, list[int]]:
    """(name, bytes, dims) of an ONNX TensorProto, external or inline."""
    name, dims, dtype, raw, external, typed = "", [], 1, None, {}, 0
    for num, wire, v in _fields(buf, *span):
        if num == 1:  # dims: packed or not
            if wire == 2:
                i, end = v
                while i < end:
                    d, i = _varint(buf, i)
                    dims.append(d)
            else:
                dims.append(v)
        elif num == 2:
            dtype = v
        elif num == 8:
            name = bytes(buf[v[0]:v[1]]).decode()
        elif num == 9:
            raw = v[1] - v[0]
        elif num in (4, 5, 7, 10, 11) and wire == 2:  # packed typed data: bytes on the wire ~ bytes in memory
            typed += v[1] - v[0]
        elif num == 13:
            entry = dict(_fields_kv(buf, v))
            external[entry.get("key", "")] = entry.get("value", "")
    count = int(np.prod(dims)) if dims else 1
    if "length" in external:
        size = int(external["length"])
    elif raw is not None:
        size = raw
    elif typed:
        size = typed
    else:
        size = count * _DTYPE_BITS.get(dtype, 32) // 8
    return name, size, dims


def _fields_kv(buf: memoryview, span: tuple[int, int]):
    for num, _, s in _fields(buf, *span):
        if num in (1, 2):
            yield ("key" if num == 1 else "value"), bytes(buf[s[0]:s[1]]).decode()


def weight_bytes(engine_dir: str | Path, manifest: dict) -> WeightBytes:
    """Classify the bytes of every initializer of the engine's graph by how a forward step reads them."""
    root = Path(engine_dir)
    model_path = root / manifest["engine"]["model_file"]
    buf = memoryview(model_path.read_bytes())
    graph = next((v for num, wire, v in _fields(buf, 0, len(buf)) if num == 7 and wire == 2), None)
    if graph is None:
        raise LlmcError(f"{model_path}: no graph in this ONNX file; the artifact is corrupt, rebuild it")
    inits: dict[str, tuple[int, list[int]]] = {}
    consumers: dict[str, set[str]] = {}
    for num, wire, v in _fields(buf, *graph):
        if num == 5 and wire == 2:
            name, size, dims = _tensor_bytes(buf, v)
            inits[name] = (size, dims)
        elif num == 1 and wire == 2:
            inputs, op = [], ""
            for n2, _, s in _fields(buf, *v):
                if n2 == 1:
                    inputs.append(bytes(buf[s[0]:s[1]]).decode())
                elif n2 == 4:
                    op = bytes(buf[s[0]:s[1]]).decode()
            for name in inputs:
                consumers.setdefault(name, set()).add(op)
    streamed = gathered = row = 0
    for name, (size, dims) in inits.items():
        ops = consumers.get(name, set())
        if ops and ops <= _GATHER_OPS:
            gathered += size
            if len(dims) >= 2:  # a table (or its per-row scales); scalars and index vectors are not read by row
                row += size // max(dims[0], 1)
        else:
            streamed += size
    files = {manifest["engine"].get("weights_file")} | {p.name for p in root.glob("*.data")}
    file_bytes = sum((root / f).stat().st_size for f in files if f and (root / f).is_file())
    return WeightBytes(streamed, gathered, row, file_bytes, len(inits))


def kv_bytes_per_token(manifest: dict) -> int:
    """Bytes of K and V that one token of context occupies across all layers."""
    kv = manifest["kv_cache"]
    if kv["dtype"] in ("float8_e4m3fn", "fp8", "float8"):
        itemsize = 1
    else:
        itemsize = np.dtype(kv["dtype"]).itemsize
    from llmc.runtime.kv_cache import layer_geometry

    geometry = layer_geometry(kv["num_layers"], kv["num_kv_heads"], kv["head_size"], kv.get("layers"))
    return 2 * sum(h * d for i, (owner, h, d) in enumerate(geometry) if owner == i) * itemsize


# -- workloads ------------------------------------------------------------------------------------

def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, length).tolist() for _ in range(count)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def decode_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """One decode run of ``prompts`` together: aggregate decode tok/s (prompt pass excluded), TTFT (s),
    and the tokens actually generated."""
    outs = engine.generate(prompts, _greedy(new_tokens))
    t_first = max(o.ttft for o in outs)
    t_end = max(o.latency for o in outs)
    made = sum(len(o.token_ids) for o in outs)
    return {"tok_s": len(prompts) * (new_tokens - 1) / (t_end - t_first), "ttft_s": t_first,
            "tokens": made, "seconds": t_end}


def prefill_run(engine: Engine, prompt: list[int]) -> dict:
    """One prefill of ``prompt``: tok/s = prompt tokens / TTFT."""
    out = engine.generate([prompt], _greedy(1))[0]
    return {"tok_s": len(prompt) / out.ttft, "ttft_s": out.ttft, "tokens": len(out.token_ids)}


def request_stream(engine: Engine, prompts: list[list[int]], new_tokens: int, rate_per_s: float,
                   seed: int = 0) -> dict:
    """Poisson arrivals of ``prompts``, each asking ``new_tokens``; TTFT and inter-token latency (ms)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, len(prompts)))
    params = _greedy(new_tokens)
    start = time.perf_counter()
    submitted: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    pending = 0
    while pending < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending < len(prompts) and arrivals[pending] <= now:
            rid = engine.submit(prompts[pending], params)
            submitted[rid] = float(arrivals[pending])
            token_times[rid] = []
            pending += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending] - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            if o.new_token_ids and o.request_id in token_times:
                token_times[o.request_id].extend([t] * len(o.new_token_ids))
            if o.finished:
                engine.result(o.request_id)  # read once so the engine forgets it
    elapsed = time.perf_counter() - start
    ttft = [token_times[r][0] - submitted[r] for r in submitted if token_times[r]]
    itl = [b - a for r in submitted for a, b in zip(token_times[r], token_times[r][1:], strict=False)]

    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q) * 1000), 3) if xs else None

    made = sum(len(v) for v in token_times.values())
    return {"requests": len(prompts), "rate_per_s": rate_per_s, "tokens": made,
            "tok_s": round(made / elapsed, 2), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def _spec_figures(before, after) -> dict:
    """Speculative decoding's figures between two ``EngineStats`` (empty without speculation)."""
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    if not drafted:
        return {}
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    verifies = after.spec_num_verify_steps - before.spec_num_verify_steps
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4),
            "spec_mean_accepted_length": round(accepted / verifies, 4) if verifies else 0.0}


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
    pool_tokens = max(max(cfg.batches) * (cfg.input_len + cfg.output_len), cfg.prefill_len + 1,
                      cfg.stream_requests * (cfg.input_len + cfg.output_len)) + 64
    # Prefix caching off: every workload repeats its prompts, and a cached prompt would measure a
    # cache lookup instead of a prefill.
    from llmc.runtime.speculative import SpeculativeConfig

    spec = SpeculativeConfig.parse(cfg.speculative) if cfg.speculative else None
    engine = Engine.load(engine_dir, num_threads=cfg.threads, kv_cache_tokens=pool_tokens,
                         max_num_seqs=max(256, max(cfg.batches), cfg.stream_requests), enable_prefix_caching=False,
                         speculative=spec)
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
        prompt = _prompts(vocab, 1, cfg.prefill_len, cfg.seed + 7)[0]
        for _ in range(cfg.warmup):
            prefill_run(engine, prompt)
        runs = [prefill_run(engine, prompt) for _ in range(cfg.repeats)]
        result.rows.append({
            "workload": f"prefill_{cfg.prefill_len}", "batch": 1, "input_len": cfg.prefill_len,
            "tok_s": round(statistics.median(r["tok_s"] for r in runs), 2),
            "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 3),
            "tokens_requested": 1, "tokens_generated": min(r["tokens"] for r in runs),
            "runs_tok_s": [round(r["tok_s"], 2) for r in runs]})
    if "decode" in cfg.workloads:
        for b in cfg.batches:
            say(f"decode batch {b}: {cfg.input_len}-token prompts, {cfg.output_len} new tokens")
            prompts = _prompts(vocab, b, cfg.input_len, cfg.seed + 100 + b)
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
            result.rows.append({
                "workload": f"decode_b{b}", "batch": b, "input_len": cfg.input_len, "output_len": cfg.output_len,
                "tok_s": round(tok_s, 2), "ms_per_step": round(1000 * b / tok_s, 3),
                "ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in runs), 3),
                "tokens_requested": b * cfg.output_len, "tokens_generated": min(r["tokens"] for r in runs),
                "bytes_per_token": int(per_token), "achieved_GBps": round(achieved, 3),
                "machine_read_GBps": round(bandwidth, 2), "machine_read_GBps_before_after": [
                    before.read_GBps, after.read_GBps],
                "roofline_fraction": round(achieved / bandwidth, 4),
                "roofline_tok_s": round(bandwidth * 1e9 / per_token, 1),
                "runs_tok_s": [round(r["tok_s"], 2) for r in runs], **_spec_figures(s0, s1)})
    if "stream" in cfg.workloads:
        say(f"request stream: {cfg.stream_requests} requests at {cfg.stream_rate}/s")
        prompts = _prompts(vocab, cfg.stream_requests, cfg.input_len, cfg.seed + 1)
        stream = request_stream(engine, prompts, cfg.output_len, cfg.stream_rate, cfg.seed)
        requested = cfg.stream_requests * cfg.output_len
        if stream["tokens"] != requested:
            raise RuntimeError(f"request stream: the engine made {stream['tokens']} tokens, not the {requested} "
                               "requested (a bug: please report it)")
        result.rows.append({"workload": "stream", "input_len": cfg.input_len, "output_len": cfg.output_len,
                            "tokens_requested": requested, "tokens_generated": stream.pop("tokens"), **stream})
    machine["load_avg_end"] = load_average()
    return result
