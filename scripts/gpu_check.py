#!/usr/bin/env python
"""One GPU check for llmc: everything GPU-side in one run, with only torch, Triton and CUDA needed.

Sections (each records its results; a failure in one does not stop the others):

1. ``correctness``: the Triton PagedAttention kernel against the numpy reference on random
   decode and mixed prefill+decode batches (GQA 1/4/8, head sizes 64/128, blocks 16/32,
   float16/bfloat16/float32, FP8 KV with bit-exact codes, sliding window + softcap, split-KV, attention
   sinks, ALiBi, chunked local attention),
   and the kernel's FP8 codec against the project's E4M3 codec over every code.
2. ``aot``: the ahead-of-time PTX for this GPU's SM (what a TensorRT engine embeds), assembled with
   ptxas and launched through the CUDA driver exactly as TensorRT's AOT plugin launches it
   (inputs, int32 scalars, outputs; no Triton launcher), compared with the JIT kernel.
3. ``bandwidth``: decode at batch 1/8/64 x context 512/4k/32k (Llama-3-8B attention: 32 query
   heads, 8 KV heads, head size 128, float16, blocks of 16 scattered over the pool): achieved KV
   read bandwidth as a fraction of this device's measured copy bandwidth, side by side with
   ``torch.nn.functional.scaled_dot_product_attention`` on the same shapes (contiguous K/V,
   ``enable_gqa``), and the largest difference between the two outputs.
4. ``tensorrt``: where the ``tensorrt`` module imports, build an engine from a tiny Llama with
   ``llmc build --gpu auto`` and compare its greedy tokens with transformers'.
5. ``calibration``: the default model's int4-awq and int4-gptq calibration (forward and statistics) on
   the GPU and on the CPU: the same INT4 codes but where GEMM rounding moves a value across a
   rounding boundary, and how long each took.
6. ``recurrent``: the hybrid models' Triton kernels (CausalConv1d, the gated delta rule, Mamba2's SSD
   scan) against their torch references at production shapes, chunked = whole, their AOT cubins
   launched through the driver = the JIT kernels bit for bit, decode/prefill timings, and tiny
   Qwen3.5 / Nemotron-H / LFM2 CUDA engines vs transformers (graphs = eager = alone); see
   ``scripts/gpu_recurrent_check.py``.
7. ``lora``: the multi-LoRA shrink/expand kernels at Llama-3-8B shapes (four rank-16 slots mixed with rows
   without an adapter) against the torch reference, their AOT cubins launched through the driver = the JIT
   kernels bit for bit, and their time per step beside the torch reference's; see ``scripts/gpu_lora_check.py``.
8. ``images``: a tiny LLaVA's CUDA image engine (its encoder program and AOT kernels on the GPU) against transformers
   on the GPU (fp32 tokens and log-probabilities, bf16 features), CUDA graphs after an image, and a Gemma-3-4B-shaped
   SigLIP's encoder time beside transformers' tower; see ``scripts/gpu_image_check.py``.

Prints a table per section and writes everything to ``--out`` (JSON). Exit status 0 when every
check that ran passed, 1 otherwise. ``--cpu-smoke`` runs sections 1-2 and 6-7's kernel checks on tiny
shapes under the Triton interpreter (PTX compiled, not launched) and skips the rest: what CI can run
without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

CASES = [
    # name, heads, kv heads, head size, block, sequences (context after step, new tokens), extras
    ("decode gqa4 d128 bs16", 32, 8, 128, 16, [(1500, 1), (700, 1), (33, 1), (2047, 1)], {}),
    ("mixed gqa1 d64 bs32", 8, 8, 64, 32, [(600, 1), (300, 300), (900, 64), (5, 1)], {}),
    ("mixed gqa8 d128 bs16", 64, 8, 128, 16, [(800, 1), (257, 257), (1200, 100)], {}),
    ("decode gqa8 d64 split-kv", 16, 2, 64, 32, [(3000, 1), (900, 1)], {"num_splits": 8}),
    ("mixed window+softcap", 16, 4, 64, 16, [(1000, 1), (400, 130)], {"window": 256, "softcap": 30.0}),
    # The attention variants added since the last GPU run (never yet run on a GPU): gpt-oss's sinks with its
    # 128-token window, bloom/mpt's ALiBi (a head count that is not a power of two: the slopes' second series),
    # llama4's chunked local attention, and sinks through the split-KV combine.
    ("mixed sinks+window gqa8", 64, 8, 64, 16, [(900, 1), (300, 140), (40, 1)], {"sinks": True, "window": 128}),
    ("decode sinks split-kv", 16, 2, 64, 32, [(3000, 1), (700, 1)], {"sinks": True, "num_splits": 8}),
    ("mixed alibi 12 heads", 12, 12, 64, 16, [(700, 1), (260, 260), (90, 9)], {"alibi": 8.0}),
    ("decode alibi split-kv", 16, 16, 128, 16, [(2500, 1), (600, 1)], {"alibi": 8.0, "num_splits": 4}),
    ("mixed chunked 256", 40, 8, 128, 16, [(1100, 1), (600, 300), (255, 2)], {"chunk": 256}),
]
DTYPES = [("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("fp16", "fp8"), ("bf16", "fp8")]
SMOKE_CASES = [
    ("smoke decode gqa4", 8, 2, 64, 16, [(70, 1), (20, 1)], {}),
    ("smoke mixed gqa1", 4, 4, 64, 16, [(40, 1), (24, 24), (50, 7)], {"window": 30}),
    ("smoke sinks", 4, 2, 64, 16, [(50, 1), (20, 20)], {"sinks": True, "window": 16}),
    ("smoke alibi 6 heads", 6, 6, 64, 16, [(45, 1), (18, 18)], {"alibi": 8.0}),
    ("smoke chunked", 4, 2, 64, 16, [(60, 1), (30, 12)], {"chunk": 16}),
]
# GPU tolerances: scores are exact-product float32 sums; the softmax weights are rounded to the
# activation dtype before P @ V (tensor cores), adding ~2^-11 (fp16) / 2^-8 (bf16) relative error.
GPU_ATOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 4e-2}
SMOKE_ATOL = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2}
BW_SHAPES = [(b, c) for b in (1, 8, 64) for c in (512, 4096, 32768)]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="JSON report path (default: gpu_check.json)")
    p.add_argument("--cpu-smoke", action="store_true", help="interpreter, tiny shapes, no launch: for CI")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new bandwidth rows after this many seconds (default 420: under 8 min)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per bandwidth measurement")
    p.add_argument("--quick", action="store_true",
                   help="the bf16 CUDA engine alone (build, graphs vs eager, decode b1/8/64, prefill): a short lease")
    p.add_argument("--profile", action="store_true",
                   help="after the engine section: torch.profiler over decode steps of its bf16 engine at batch 1 "
                        "and 64, per kernel and per kind of work (where the step's time goes)")
    p.add_argument("--skip", action="append", default=[],
                   choices=["engine", "correctness", "aot", "bandwidth", "tensorrt", "calibration", "recurrent",
                            "lora", "images"])
    return p.parse_args(argv)


def section(name, report, fn):
    t0 = time.time()
    try:
        report[name] = fn()
    except Exception as exc:  # a crashed section is a failed check, reported with its traceback
        partial = report.get(name) if isinstance(report.get(name), dict) else {}
        report[name] = {**partial, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()}
    report[name]["seconds"] = round(time.time() - t0, 1)


def table(title, header, rows):
    print(f"\n== {title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


# ---------------------------------------------------------------------------------------------


def run_correctness(smoke: bool, device: str):
    import numpy as np
    import torch

    from llmc.plugins.paged_attention import triton_kernel as tk
    from llmc.quant.minifloat import E4M3
    from llmc.testing.paged_attention import check_case, make_case

    rows = []
    cases = SMOKE_CASES if smoke else CASES
    dtypes = DTYPES[:1] + DTYPES[3:4] if smoke else DTYPES
    atol = SMOKE_ATOL if smoke else GPU_ATOL
    for name, hq, hkv, d, bs, seqs, extra in cases:
        for act, cache in dtypes:
            seed = int(np.random.SeedSequence().entropy % 2**32)
            rng = np.random.default_rng(seed)
            inputs, caches, attrs = make_case(rng, hq=hq, hkv=hkv, d=d, bs=bs, seqs=seqs,
                                              q_scale=4.0 if extra.get("softcap") else 1.0)
            attrs.update(sliding_window=extra.get("window", 0), softcap=extra.get("softcap", 0.0),
                         alibi_max_bias=extra.get("alibi", 0.0), attention_chunk=extra.get("chunk", 0))
            if extra.get("sinks"):  # per-head sink logits around the scores' scale, so they move the softmax
                attrs["sinks"] = rng.standard_normal(hq).astype(np.float32) * 2.0
            kw = {"num_splits": extra["num_splits"]} if "num_splits" in extra else {}
            row = {"case": name, "act": act, "cache": cache, "seed": seed}
            try:
                got, want = check_case(inputs, caches, attrs, atol=atol, act=act,
                                       cache=act if cache == "fp8" else cache,
                                       fp8_scales=(0.009, 0.011) if cache == "fp8" else None, device=device, **kw)
                row.update(ok=True, max_abs_diff=float(np.abs(got - want).max()))
            except AssertionError as exc:
                row.update(ok=False, error=str(exc)[:2000])
            rows.append(row)
    # FP8 codec over every code and a spread of values (bit-exact against quant.minifloat.E4M3).
    x = np.concatenate([E4M3.table[np.isfinite(E4M3.table)], np.random.default_rng().standard_normal(100_000) * 100])
    x = x.astype(np.float32)
    codes_in = np.resize(np.arange(256, dtype=np.uint8), x.shape)
    codes, decoded = tk.fp8_codec(torch.from_numpy(x).to(device), torch.from_numpy(codes_in).to(device), 0.5)
    finite = np.isfinite(E4M3.decode(codes_in))
    codec_ok = bool((codes.cpu().numpy() == E4M3.encode(x / np.float32(0.5))).all()
                    and (decoded.float().cpu().numpy()[finite] == E4M3.decode(codes_in)[finite]).all())
    rows.append({"case": "fp8 codec (encode + decode, all codes)", "act": "-", "cache": "fp8", "ok": codec_ok})
    table("correctness: Triton kernel vs numpy reference", ["case", "act", "cache", "ok", "max |diff|"],
          [[r["case"], r["act"], r["cache"], "ok" if r["ok"] else "FAIL", f"{r.get('max_abs_diff', 0):.2e}"]
           for r in rows])
    return {"ok": all(r["ok"] for r in rows), "cases": rows}


# ---------------------------------------------------------------------------------------------


def _cuda_launch(kernel, args, grid, sm):
    """Launch the AOT PTX through the CUDA driver with TensorRT's argument layout (no Triton launcher), by the
    CUDA engine's own loader (llmc.runtime.workers.cuda.kernels)."""
    import torch

    from llmc.plugins.paged_attention import aot
    from llmc.runtime.workers.cuda.kernels import KernelInfo, LoadedKernel

    info = KernelInfo(name=kernel.name, file="", sm=sm, num_warps=kernel.num_warps, shared_mem=kernel.shared_mem,
                      block_q=kernel.block_q, num_kv_heads=kernel.num_kv_heads, variant="", key="")
    LoadedKernel(info, aot.assemble(kernel.ptx, sm)).launch(grid, args, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


def run_aot(smoke: bool, device: str):
    import numpy as np
    import torch

    from llmc.plugins.paged_attention import aot
    from llmc.plugins.paged_attention import triton_kernel as tk
    from llmc.testing.paged_attention import make_case

    sm = 90 if smoke else (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability())
    rows = []
    for act, cache in (("fp16", "fp16"), ("bf16", "u8")):
        cfg = tk.KernelConfig(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, scale=128**-0.5,
                              act_dtype=act, cache_dtype=cache)
        t0 = time.time()
        (kernel,) = aot.compile_ptx(cfg, (sm,))
        row = {"sm": sm, "target": kernel.target, "act": act, "cache": cache, "name": kernel.name,
               "shared_mem": kernel.shared_mem, "num_warps": kernel.num_warps, "ptx_bytes": len(kernel.ptx),
               "compile_s": round(time.time() - t0, 1), "cubin_bytes": len(aot.assemble(kernel.ptx, sm))}
        if not smoke:
            dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[act]
            rng = np.random.default_rng()
            inputs, (kc, vc), attrs = make_case(rng, hq=32, hkv=8, d=128, bs=16, seqs=[(900, 1), (300, 120), (64, 1)])
            t = {k: torch.from_numpy(v).cuda() for k, v in inputs.items()}
            for name in ("query", "key", "value"):
                t[name] = t[name].to(dt)
            if cache == "u8":
                caches = [torch.randint(0, 0x7E, kc.shape, dtype=torch.uint8, device="cuda") for _ in range(2)]
                scales = torch.tensor([0.02, 0.03], device="cuda")
            else:
                caches = [torch.from_numpy(c).to(dt).cuda() for c in (kc, vc)]
                scales = torch.ones(2, device="cuda")
            jit_caches = [c.clone() for c in caches]
            want = tk.paged_attention(**t, k_cache=jit_caches[0], v_cache=jit_caches[1], **attrs,
                                      kv_scales=scales if cache == "u8" else None, block_m=kernel.config["block_m"],
                                      block_n=kernel.config["block_n"])
            out = torch.zeros_like(want)
            args = [t["query"], t["key"], t["value"], t["slot_mapping"], t["block_tables"], t["context_lens"],
                    t["query_start_loc"], caches[0], caches[1], scales, len(inputs["context_lens"]),
                    inputs["block_tables"].shape[1], out, caches[0], caches[1]]
            _cuda_launch(kernel, args, kernel.grid(inputs["query"].shape[0], len(inputs["context_lens"])), sm)
            row["max_abs_diff_vs_jit"] = float((out.float() - want.float()).abs().max())
            row["caches_equal_jit"] = all(torch.equal(a, b) for a, b in zip(caches, jit_caches, strict=True))
            # Same tiles, same math: expect equality up to instruction scheduling (ordering of float sums).
            row["ok"] = row["max_abs_diff_vs_jit"] <= GPU_ATOL[act] / 10 and row["caches_equal_jit"]
        else:
            row["ok"] = True
        row["ok"] = row["ok"] and kernel.target.startswith(f"sm_{sm}") and kernel.shared_mem <= aot.SHARED_MEM_LIMIT
        rows.append(row)
    table(f"aot: PTX for sm_{sm}" + (" (compiled, not launched)" if smoke else ", launched like TensorRT"),
          ["target", "act", "cache", "shared B", "warps", "PTX B", "compile s", "vs JIT", "ok"],
          [[r["target"], r["act"], r["cache"], r["shared_mem"], r["num_warps"], r["ptx_bytes"], r["compile_s"],
            r.get("max_abs_diff_vs_jit", "-"), "ok" if r["ok"] else "FAIL"] for r in rows])
    return {"ok": all(r["ok"] for r in rows), "kernels": rows}


# ---------------------------------------------------------------------------------------------


def _time_cuda(fn, iters):
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def run_bandwidth(args, t_start):
    import torch
    import torch.nn.functional as F

    from llmc.plugins.paged_attention import flash_requests as fr
    from llmc.plugins.paged_attention import triton_kernel as tk

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    n = 1 << 31  # 2 GiB copied: read + write
    buffers = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    copy_bw = 2 * n / _time_cuda(lambda: buffers[1].copy_(buffers[0]), args.iters)
    buffers.clear()
    hq, hkv, d, bs = 32, 8, 128, 16
    rows = []
    for b, ctx in BW_SHAPES:
        if time.time() - t_start > args.budget_s:
            rows.append({"batch": b, "context": ctx, "skipped": "time budget"})
            continue
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(b * 100003 + ctx)
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16, generator=g)
        k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.float16, generator=g)
        v = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.float16, generator=g)
        nblk = ctx // bs
        # The paged pool holds the same K/V in blocks scattered by a random permutation.
        perm = torch.randperm(b * nblk, device="cuda", generator=g)
        pool_k = torch.empty(b * nblk, hkv, bs, d, device="cuda", dtype=torch.float16)
        pool_v = torch.empty_like(pool_k)
        pool_k[perm] = k.view(b, hkv, nblk, bs, d).permute(0, 2, 1, 3, 4).reshape(b * nblk, hkv, bs, d)
        pool_v[perm] = v.view(b, hkv, nblk, bs, d).permute(0, 2, 1, 3, 4).reshape(b * nblk, hkv, bs, d)
        block_tables = perm.view(b, nblk).to(torch.int64)
        last = ctx - 1
        step = dict(
            query=q.reshape(b, hq * d), key=k[:, :, last].reshape(b, hkv * d).contiguous(),
            value=v[:, :, last].reshape(b, hkv * d).contiguous(),
            slot_mapping=block_tables[:, last // bs] * bs + last % bs, block_tables=block_tables,
            context_lens=torch.full((b,), ctx, dtype=torch.int64, device="cuda"),
            query_start_loc=torch.arange(b + 1, dtype=torch.int64, device="cuda"),
        )
        splits = tk.choose_num_splits(b, hkv, ctx, props.multi_processor_count)
        out = torch.empty(b, hq * d, device="cuda", dtype=torch.float16)

        def ours(splits=splits, out=out, step=step, pool_k=pool_k, pool_v=pool_v):
            tk.paged_attention(**step, k_cache=pool_k, v_cache=pool_v, num_heads=hq, num_kv_heads=hkv,
                               scale=d**-0.5, num_splits=splits, out=out)

        def sdpa(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        # The CUDA engine's split-KV decode (plugins/paged_attention/flash.py, issue 51 item 4) as its session launches
        # it, replayed from a CUDA graph as decode steps are (no Python launch overhead in the timing).
        flash_out = torch.empty_like(out)
        flash_kernels = fr.jit_kernels({"num_heads": hq, "num_kv_heads": hkv, "head_size": d, "scale": d**-0.5},
                                       act="fp16", cache="fp16", block_size=bs, interpret=False)
        ones = torch.ones(2, dtype=torch.float32, device="cuda")

        def flash(step=step, pool_k=pool_k, pool_v=pool_v, flash_out=flash_out, flash_kernels=flash_kernels,
                  ones=ones):
            fr.run_attention(flash_kernels, step["query"], step["key"], step["value"], step["slot_mapping"],
                             step["block_tables"], step["context_lens"], step["query_start_loc"], pool_k, pool_v,
                             ones, num_sms=props.multi_processor_count, out=flash_out)

        flash()  # Triton's JIT compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            flash()
        t_flash = _time_cuda(graph.replay, args.iters)
        t_ours = _time_cuda(ours, args.iters)
        t_sdpa = _time_cuda(sdpa, args.iters)
        ref = sdpa().reshape(b, hq * d)
        kv_bytes = 2 * b * ctx * hkv * d * 2
        row = {"batch": b, "context": ctx, "splits": splits, "kv_bytes": kv_bytes,
               "flash_splits": fr.decode_num_splits(b, hkv, ctx, props.multi_processor_count),
               "max_abs_diff_vs_sdpa": float((out.float() - ref.float()).abs().max()),
               "flash_max_abs_diff_vs_sdpa": float((flash_out.float() - ref.float()).abs().max())}
        for who, sec in (("ours", t_ours), ("flash", t_flash), ("sdpa", t_sdpa)):
            row.update({f"{who}_us": sec * 1e6, f"{who}_gbs": kv_bytes / sec / 1e9,
                        f"{who}_frac": kv_bytes / sec / copy_bw})
        rows.append(row)
        del q, k, v, pool_k, pool_v, step, out, ref, flash_out, graph
    ok = all(max(r.get("max_abs_diff_vs_sdpa", 0.0), r.get("flash_max_abs_diff_vs_sdpa", 0.0)) < 1e-2 for r in rows)
    table(f"bandwidth: decode, {hq}/{hkv} heads, D {d}, fp16, block {bs}; copy bandwidth {copy_bw / 1e9:.0f} GB/s",
          ["batch", "context", "splits", "ours us", "ours frac", "flash splits", "flash us", "flash frac", "sdpa us",
           "sdpa frac", "|ours-sdpa|"],
          [[r["batch"], r["context"], "-", "skipped: " + r["skipped"], "", "", "", "", "", "", ""] if "skipped" in r
           else [r["batch"], r["context"], r["splits"], f"{r['ours_us']:.1f}", f"{r['ours_frac']:.2f}",
                 r["flash_splits"], f"{r['flash_us']:.1f}", f"{r['flash_frac']:.2f}", f"{r['sdpa_us']:.1f}",
                 f"{r['sdpa_frac']:.2f}", f"{r['max_abs_diff_vs_sdpa']:.1e}"] for r in rows])
    return {"ok": ok, "copy_bandwidth_gbs": copy_bw / 1e9, "device": props.name, "sms": props.multi_processor_count,
            "shape": {"num_heads": hq, "num_kv_heads": hkv, "head_size": d, "block_size": bs, "dtype": "fp16"},
            "rows": rows, "note": "bytes = K and V of every cached position read once; medians of CUDA-event timings"}


# ---------------------------------------------------------------------------------------------


# INT4 codes may differ between GPU and CPU calibration only where GEMM rounding moves a value across a rounding
# boundary or an AWQ scale / GPTQ update by a step: a few percent of them at most, on average over the linears.
CALIB_CODE_DIFF_MAX = 0.05


def run_calibration(devices=("cpu", "cuda")):
    import numpy as np

    from llmc.compiler.binding import param_reader
    from llmc.compiler.checkpoint import load_checkpoint
    from llmc.quant import int4
    from llmc.quant.recipe import QuantRecipe
    from llmc.quant.stage import QuantStage

    ckpt = load_checkpoint(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "default-model"))
    rows = []
    for quant in ("int4-awq", "int4-gptq"):
        got, secs, stages = [], [], []
        for device in devices:
            t0 = time.time()
            # Each stage is kept until its codes are compared: its INT4 weights wait in its spill directory, which
            # goes with the stage (the first GPU run lost the CPU stage's files when the CUDA one replaced it).
            stages.append(QuantStage(ckpt, QuantRecipe(quant=quant, calib_device=device), params=param_reader(ckpt)))
            got.append(stages[-1]._calibrate())
            secs.append(round(time.time() - t0, 2))
        # Codes and scales apart: the stop-33 run compared dequantized values, where a scale off in its last bit
        # makes its whole group "differ" (88% / 77% then), which says nothing about the codes.
        code_diffs, scale_diffs = [], []
        for name, lq in got[0].linears.items():
            a, b = int4.materialize(lq.weights), int4.materialize(got[1].linears[name].weights)
            code_diffs.append(float(np.mean(a.q != b.q)))
            scale_diffs.append(float(np.max(np.abs(a.scales - b.scales) / np.maximum(np.abs(a.scales), 1e-30))))
        mean_codes = float(np.mean(code_diffs))
        rows.append({"quant": quant, "cpu_s": secs[0], "cuda_s": secs[1],
                     "max_code_diff": round(max(code_diffs), 5), "mean_code_diff": round(mean_codes, 5),
                     "max_scale_rel_diff": float(max(scale_diffs)),
                     "median_scale_rel_diff": float(np.median(scale_diffs)),
                     "linears": len(code_diffs), "ok": mean_codes < CALIB_CODE_DIFF_MAX})
    table("calibration on the GPU vs the CPU (default model)",
          ["quant", "cpu s", "cuda s", "codes differ (mean / max)", "scales rel. diff (median / max)"],
          [[r["quant"], r["cpu_s"], r["cuda_s"], f"{r['mean_code_diff']} / {r['max_code_diff']}",
            f"{r['median_scale_rel_diff']:.1e} / {r['max_scale_rel_diff']:.1e}"] for r in rows])
    return {"ok": all(r["ok"] for r in rows), "rows": rows, "limit": CALIB_CODE_DIFF_MAX}


def run_tensorrt():
    import importlib.util
    import subprocess
    import tempfile

    if importlib.util.find_spec("tensorrt") is None:
        return {"ok": True, "skipped": "tensorrt is not importable here (pip install tensorrt-cu13 to run this part)"}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmc.testing.checkpoints import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_llama(os.path.join(tmp, "ckpt"))
        out = os.path.join(tmp, "engine")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(ckpt), "--gpu", "auto", "-o", out,
                               "--json", "--no-cache"], capture_output=True, text=True)
        result = {"build_s": round(time.time() - t0, 1), "build_exit": proc.returncode}
        if proc.returncode != 0:
            result.update(ok=False, error=(proc.stdout + proc.stderr)[-3000:])
            return result
        prompt = "The for statement"
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
        ids = tok(prompt, return_tensors="pt").input_ids
        want = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        try:
            from llmc.runtime import Engine, SamplingParams

            engine = Engine.load(out)
            got = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
        except Exception as exc:  # the engine built; this runtime may not execute TensorRT engines yet
            result.update(ok=True, skipped=f"engine built, but llmc.runtime could not run it: {type(exc).__name__}: "
                          f"{str(exc)[:500]}")
            return result
        agree = sum(1 for a, b in zip(got, want, strict=False) if a == b)
        result.update(ok=got == want, greedy_tokens_engine=got, greedy_tokens_transformers=want, agree=agree)
        return result


# ---------------------------------------------------------------------------------------------


def print_engine(r: dict) -> None:
    if "rows" in r:
        table("engine: 1B shape (Llama-3.2-1B, vocab 8192), decode 128 new tokens after 128-token prompts",
              ["who", "batch", "tok/s", "roofline frac", "note"],
              [[x["who"], x["batch"], f"{x['tok_s']:.1f}" if x.get("tok_s") else "-",
                f"{x['roofline_frac']:.2f}" if x.get("roofline_frac") else "-",
                x.get("error", "") or (f"greedy agree {x['greedy_agree_with_bf16']:.2f}"
                                       if "greedy_agree_with_bf16" in x else "")] for x in r["rows"]])
    for k in ("parity", "batched_equals_single", "graphs_equal_eager", "attention_route", "prefill_llmc_tok_s",
              "prefill_transformers_tok_s", "copy_bandwidth_gbs", "make_model_s", "sampling"):
        if k in r:
            print(f"  {k}: {r[k]}")
    for b in r.get("builds", []):
        print(f"  build rc {b['rc']} {b.get('s')} s: {b['cmd']}" + ("" if b["rc"] == 0 else f"\n{b['tail']}"))


def _run_profile(report: dict) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_engine_check import run_profile

    return run_profile(report)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    if args.cpu_smoke:
        # The interpreter must be chosen before triton is first imported (it fixes tl's own functions then).
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    device = "cpu" if args.cpu_smoke else "cuda"
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch; use --cpu-smoke on a machine without a GPU", file=sys.stderr)
        return 2
    report = {
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "env": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                "cuda": torch.version.cuda, "host": platform.node(),
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                "capability": list(torch.cuda.get_device_capability()) if device == "cuda" else None},
    }
    print(f"llmc GPU check ({report['mode']}): {report['env']['device']}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    def save():  # after every section: a run cut short still leaves what it measured
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    def gpu_only(name, fn):  # a section that needs the GPU itself: recorded as skipped under --cpu-smoke
        if name in args.skip:
            return
        if args.cpu_smoke:
            report[name] = {"ok": True, "skipped": "no GPU (--cpu-smoke)"}
        else:
            section(name, report, fn)
        save()

    if "engine" not in args.skip:
        if args.cpu_smoke:
            report["engine"] = {"ok": True, "skipped": "no GPU (--cpu-smoke)"}
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_engine_check import run_engine, run_quick

            if args.quick:
                section("engine", report, lambda: run_quick(report))
                args.skip += ["bandwidth", "correctness", "aot", "tensorrt", "recurrent", "lora", "images"]
            else:  # the kernel sections after it need about 90 s
                section("engine", report, lambda: run_engine(args.budget_s - 90, t_start, report))
            print_engine(report["engine"])
        save()
        if args.profile:
            gpu_only("profile", lambda: _run_profile(report))
    gpu_only("bandwidth", lambda: run_bandwidth(args, time.time() - args.budget_s + 40))
    if "correctness" not in args.skip:
        section("correctness", report, lambda: run_correctness(args.cpu_smoke, device))
        save()
    if "aot" not in args.skip:
        section("aot", report, lambda: run_aot(args.cpu_smoke, device))
        save()
    gpu_only("tensorrt", run_tensorrt)
    gpu_only("calibration", run_calibration)
    if "recurrent" not in args.skip:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_recurrent_check import run_recurrent

        section("recurrent", report, lambda: run_recurrent(args.cpu_smoke, device, _time_cuda))
        save()
    if "lora" not in args.skip:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_lora_check import run_lora

        copy_bw = report.get("bandwidth", {}).get("copy_bandwidth_gbs")
        section("lora", report, lambda: run_lora(args.cpu_smoke, device, _time_cuda, copy_bw))
        save()
    if "images" not in args.skip:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_image_check import run_images

        gpu_only("images", lambda: run_images(False, device, _time_cuda))
    for name in ("engine", "profile", "correctness", "aot", "bandwidth", "tensorrt", "calibration", "recurrent",
                 "lora", "images"):
        r = report.get(name)
        if r is not None and ("error" in r or "skipped" in r):
            print(f"\n{name}: " + (f"ERROR {r['error']}\n{r.get('traceback', '')}" if "error" in r
                                   else f"skipped: {r['skipped']}"))
    report["ok"] = all(report[k]["ok"] for k in ("engine", "profile", "correctness", "aot", "bandwidth", "tensorrt",
                                                 "calibration", "recurrent", "lora", "images") if k in report)
    report["seconds"] = round(time.time() - t_start, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'PASS' if report['ok'] else 'FAIL'} in {report['seconds']} s; report: {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
