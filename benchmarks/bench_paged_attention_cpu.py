"""Micro-benchmark: PagedAttention decode step, C++ CPU kernel vs the numpy reference.

    python benchmarks/bench_paged_attention_cpu.py [--quick]

One call = one layer's PagedAttention for a decode step (one new token per sequence: write its
K/V, attend over the context). Prints a table of µs per call and saves it as JSON under
benchmarks/results/. Columns: the kernel as dispatched with every thread, with one thread, and
with the x86-64-v2 baseline code path (no AVX2), then the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from llmc.plugins.paged_attention import reference
from llmc.plugins.paged_attention.cpu import load_kernel, paged_attention_cpu

BLOCK_SIZE = 16
HEADS = [(9, 3, 64), (32, 8, 64)]  # (num_heads, num_kv_heads, head_size)
BATCHES = [1, 8]
CONTEXTS = [128, 1024]


def decode_case(rng: np.random.Generator, batch: int, ctx: int, hq: int, hkv: int, d: int):
    nb = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * nb + 4
    perm = rng.permutation(num_blocks)
    block_tables = perm[: batch * nb].reshape(batch, nb).astype(np.int64)
    pos = ctx - 1
    slots = block_tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    shape = (num_blocks, hkv, BLOCK_SIZE, d)
    inputs = dict(
        query=rng.standard_normal((batch, hq * d)).astype(np.float32),
        key=rng.standard_normal((batch, hkv * d)).astype(np.float32),
        value=rng.standard_normal((batch, hkv * d)).astype(np.float32),
        slot_mapping=slots.astype(np.int64),
        block_tables=block_tables,
        context_lens=np.full(batch, ctx, dtype=np.int64),
        query_start_loc=np.arange(batch + 1, dtype=np.int64),
        k_cache=rng.standard_normal(shape).astype(np.float32),
        v_cache=rng.standard_normal(shape).astype(np.float32),
    )
    return inputs, dict(num_heads=hq, num_kv_heads=hkv, scale=1.0 / math.sqrt(d))


def time_us(fn, min_time: float) -> float:
    """Median over 5 rounds of the mean time per call, each round running for about min_time/5 s."""
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    number = max(1, int(min_time / 5 / one))
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - t0) / number)
    return statistics.median(rounds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing (noisier)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "bench_paged_attention_cpu.json"
    )
    args = parser.parse_args()
    min_time = 0.1 if args.quick else 0.5

    kernel = load_kernel()
    threads = kernel.get_num_threads()
    isa = kernel.get_isa()
    rng = np.random.default_rng(0)
    rows = []
    header = (
        f"{'batch':>5} {'ctx':>5} {'Hq':>3} {'Hkv':>3} {'D':>3} | "
        f"{'kernel µs':>10} {'1 thread':>9} {'baseline':>9} | {'reference µs':>12} {'speed-up':>8}"
    )
    print(f"PagedAttention decode, block_size={BLOCK_SIZE}, float32, {threads} threads, ISA {isa}")
    print(header)
    print("-" * len(header))
    for hq, hkv, d in HEADS:
        for batch in BATCHES:
            for ctx in CONTEXTS:
                inputs, attrs = decode_case(rng, batch, ctx, hq, hkv, d)
                expected = reference.paged_attention(
                    **{**inputs, "k_cache": inputs["k_cache"].copy(), "v_cache": inputs["v_cache"].copy()}, **attrs
                )
                got = paged_attention_cpu(**inputs, **attrs)
                np.testing.assert_allclose(got, expected, rtol=1e-4, atol=2e-5)

                def run_kernel(inputs=inputs, attrs=attrs):
                    paged_attention_cpu(**inputs, **attrs)

                def run_reference(inputs=inputs, attrs=attrs):
                    reference.paged_attention(**inputs, **attrs)

                us = time_us(run_kernel, min_time)
                kernel.set_num_threads(1)
                us_1t = time_us(run_kernel, min_time)
                kernel.set_num_threads(0)
                kernel._set_isa("baseline")
                us_base = time_us(run_kernel, min_time)
                kernel._set_isa("auto")
                us_ref = time_us(run_reference, min_time)
                row = dict(
                    batch=batch,
                    context=ctx,
                    num_heads=hq,
                    num_kv_heads=hkv,
                    head_size=d,
                    kernel_us=us,
                    kernel_1thread_us=us_1t,
                    kernel_baseline_isa_us=us_base,
                    reference_us=us_ref,
                    speedup=us_ref / us,
                )
                rows.append(row)
                print(
                    f"{batch:>5} {ctx:>5} {hq:>3} {hkv:>3} {d:>3} | {us:>10.1f} {us_1t:>9.1f} {us_base:>9.1f} | "
                    f"{us_ref:>12.1f} {us_ref / us:>7.0f}x"
                )

    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    result = dict(
        benchmark="paged_attention_cpu_decode",
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=dict(cpu=cpu_model, cores=os.cpu_count(), platform=platform.platform()),
        numpy=np.__version__,
        threads=threads,
        isa=isa,
        block_size=BLOCK_SIZE,
        dtype="float32",
        rows=rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
