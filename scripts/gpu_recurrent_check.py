"""The ``recurrent`` section of ``scripts/gpu_check.py``: the hybrid models' Triton kernels and CUDA engines.

- kernels: CausalConv1d, the gated delta rule and Mamba2's SSD scan (llmc.plugins.recurrent.triton_kernels) at
  production shapes (Qwen3.5-9B's Gated DeltaNet: 16 key / 32 value heads of 128, conv over 8192 channels; a
  Nemotron-H-sized Mamba2 layer: 128 heads of 64, 8 groups, state 128), bfloat16 and float32, on a step that packs a
  fresh prefill, a continued chunk, decodes and a padding row, against the torch reference
  (llmc.plugins.recurrent.torch_reference); a prefill in chunks against the same tokens in one step;
- aot: each kernel compiled ahead of time for this SM (llmc.plugins.triton_aot) and launched through the CUDA driver
  as the engine launches it (llmc.runtime.workers.cuda.kernels.LoadedKernel), against the JIT kernel, bit for bit;
- speed: decode steps at batch 1/8/64 (state bytes read + written per step over the step time, as a fraction of this
  device's copy bandwidth) and a 2048-token prefill (the recurrent form walks it token by token);
- engines: tiny random Qwen3.5, Nemotron-H and LFM2 (llmc.testing.hybrids) built with ``llmc build --gpu auto
  --dtype float32``, run on this GPU with CUDA graphs and eagerly: transformers' greedy tokens, graphs = eager,
  batched = single.

``--cpu-smoke``: the kernels on tiny shapes under the Triton interpreter and the AOT compilation (no launch); the
speed and engine parts are skipped.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = [37, 16, 1, 1, 1]  # a fresh prefill, a continued chunk, two decodes, a padding row (slot -1)
CTX = [37, 80, 300, 2, 1]
SLOTS = [3, 0, 4, 1, -1]
GPU_SHAPES = {"conv": (8192, 4), "delta": (16, 32, 128, 128), "ssd": (128, 8, 64, 128)}
SMOKE_SHAPES = {"conv": (48, 4), "delta": (2, 4, 16, 16), "ssd": (4, 2, 8, 16)}
TOL = {"fp32": 2e-4, "bf16": 3e-2}


def _meta(torch, device, rows=None, ctx=None, slots=None):
    rows, ctx, slots = rows or ROWS, ctx or CTX, slots or SLOTS
    qsl = [0]
    for r in rows:
        qsl.append(qsl[-1] + r)
    t = torch.tensor
    return (t(slots, dtype=torch.int64, device=device), t(ctx, dtype=torch.int64, device=device),
            t(qsl, dtype=torch.int64, device=device))


def _cases(torch, shapes, dtype, device, t):
    """op -> (kernel fn, request, args before the metadata, reference fn, reference attrs, state shape, grid)."""
    from llmc.plugins.recurrent import requests as rk
    from llmc.plugins.recurrent import torch_reference as ref
    from llmc.plugins.recurrent import triton_kernels as tk

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    act = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    c, k = shapes["conv"]
    hk, hv, dk, dv = shapes["delta"]
    h, grp, p, n = shapes["ssd"]
    conv_req = rk.conv_request(c, k, True, True, act)
    delta_req = rk.delta_request(hk, hv, dk, dv, True, act)
    ssd_req = rk.ssd_request(h, grp, p, n, 0.0, float("inf"), act)
    a_log = torch.log(torch.rand(h, generator=g) * 7 + 1).to(device, dtype)
    s = len(ROWS)
    return {
        "causal_conv1d": (tk.causal_conv1d_kernel, conv_req, [rnd(t, c), rnd(c, k), rnd(c)],
                          lambda args, m, st: ref.causal_conv1d(*args, *m, st, 1), (c, k - 1),
                          (s, -(-c // conv_req["constexprs"]["BLOCK_C"]), 1)),
        "gated_delta_rule": (tk.gated_delta_kernel, delta_req,
                             [rnd(t, hk * dk), rnd(t, hk * dk), rnd(t, hv * dv),
                              (-torch.rand(t, hv, generator=g)).to(device, dtype),
                              torch.rand(t, hv, generator=g).to(device, dtype)],
                             lambda args, m, st: ref.gated_delta_rule(*args, *m, st, hk, hv, True), (hv, dk, dv),
                             (s, hv, -(-dv // delta_req["constexprs"]["BLOCK_V"]))),
        "ssd_scan": (tk.ssd_scan_kernel, ssd_req,
                     [rnd(t, h * p), rnd(t, grp * n), rnd(t, grp * n), rnd(t, h), a_log, rnd(h), rnd(h)],
                     lambda args, m, st: ref.ssd_scan(*args, *m, st, h, grp), (h, p, n),
                     (s, h, -(-p // ssd_req["constexprs"]["BLOCK_P"]))),
    }


def _check_kernels(torch, shapes, device, smoke) -> list[dict]:
    out = []
    t = sum(ROWS)
    meta = _meta(torch, device)
    for dtype in (torch.float32, torch.bfloat16):
        label = "fp32" if dtype == torch.float32 else "bf16"
        for op, (fn, req, args, reference, state_shape, grid) in _cases(torch, shapes, dtype, device, t).items():
            state0 = torch.randn(6, *state_shape, device=device) * 0.5
            st_k, st_r = state0.clone(), state0.clone()
            args = [a.contiguous() for a in args]
            y = torch.empty(t, args[2].shape[1] if op == "gated_delta_rule" else args[0].shape[1], device=device,
                            dtype=dtype)
            fn[grid](*args, *meta, st_k, y, **req["constexprs"])
            want = reference(args, meta, st_r)
            scale = max(1.0, float(want.float().abs().max()))
            err = float((y.float() - want.float()).abs().max()) / scale
            serr = float((st_k - st_r).abs().max()) / max(1.0, float(st_r.abs().max()))
            row = {"op": op, "dtype": label, "max_err": err, "state_err": serr,
                   "ok": err <= TOL[label] and serr <= TOL[label] and torch.equal(st_k[2], state0[2])}
            out.append(row)
            print(f"  {op:18s} {label}: out err {err:.2e}, state err {serr:.2e} {'ok' if row['ok'] else 'FAIL'}",
                  flush=True)
    return out


def _chunked(torch, shapes, device) -> list[dict]:
    """A 96-token prefill in one step = chunks of 40, 40, then 16 decodes (float32), each kernel."""
    out = []
    for op, (fn, req, args, _, state_shape, grid) in _cases(torch, shapes, torch.float32, device, 96).items():
        state = torch.randn(2, *state_shape, device=device)

        def run(a, b, args=args, fn=fn, req=req, grid=grid, state=state, op=op):
            m = _meta(torch, device, rows=[b - a], ctx=[b], slots=[1])
            per_token = {"causal_conv1d": 1, "gated_delta_rule": 5, "ssd_scan": 4}[op]  # the rest: weights
            part = [x[a:b].contiguous() if i < per_token else x for i, x in enumerate(args)]
            width = part[2].shape[1] if op == "gated_delta_rule" else part[0].shape[1]
            y = torch.empty(b - a, width, device=device, dtype=torch.float32)
            fn[(1, *grid[1:])](*part, *m, state, y, **req["constexprs"])
            return y

        whole = run(0, 96)
        after = state[1].clone()
        parts = torch.cat([run(0, 40), run(40, 80)] + [run(i, i + 1) for i in range(80, 96)])
        err = float((parts - whole).abs().max()) / max(1.0, float(whole.abs().max()))
        serr = float((state[1] - after).abs().max()) / max(1.0, float(after.abs().max()))
        out.append({"op": op, "max_err": err, "state_err": serr, "ok": err <= 1e-4 and serr <= 1e-4})
        print(f"  {op:18s} chunked = whole: {err:.2e} / state {serr:.2e}", flush=True)
    return out


def rel_diff(a, b) -> float:
    """max |a - b| over max(1, max |b|): 1e-2 is ~2.5 bfloat16 ulps, 1e-5 ~100 float32 ulps."""
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


def _aot(torch, shapes, device, sm: int, smoke: bool) -> list[dict]:
    """Compile each kernel for ``sm``; on a GPU, launch the cubin as the engine does and compare with the JIT kernel."""
    from llmc.plugins import triton_aot
    from llmc.plugins.paged_attention import aot as pa_aot

    cases = _cases(torch, shapes, torch.bfloat16, device, sum(ROWS))
    compiled = triton_aot.compile_requests([c[1] for c in cases.values()], sm)
    rows = []
    for (op, (fn, req, args, _, state_shape, grid)), k in zip(cases.items(), compiled, strict=True):
        row = {"op": op, "target": k["target"], "ptx_bytes": len(k["ptx"]), "num_warps": k["num_warps"],
               "shared_mem": k["shared_mem"], "ok": k["target"].startswith(f"sm_{sm}")}
        if not smoke:
            from llmc.runtime.workers.cuda.kernels import KernelInfo, LoadedKernel

            info = KernelInfo(name=k["name"], file="", sm=sm, num_warps=k["num_warps"], shared_mem=k["shared_mem"],
                              block_q=0, num_kv_heads=0, variant="fused", key=req["key"], config=req["constexprs"])
            kernel = LoadedKernel(info, pa_aot.assemble(k["ptx"], sm))
            meta = _meta(torch, device)
            state0 = torch.randn(6, *state_shape, device=device)
            st_a, st_j = state0.clone(), state0.clone()
            width = args[2].shape[1] if op == "gated_delta_rule" else args[0].shape[1]
            y_a = torch.empty(sum(ROWS), width, device=device, dtype=torch.bfloat16)
            y_j = torch.empty_like(y_a)
            kernel.launch(grid, [*args, *meta, st_a, y_a], torch.cuda.current_stream().cuda_stream)
            fn[grid](*args, *meta, st_j, y_j, **req["constexprs"])
            torch.cuda.synchronize()
            # Bit-exact is not required: the JIT kernel is specialised on the launch's alignments (16-divisible
            # pointers and ints), the AOT one is not (the engine's views may not be aligned), so Triton may pick
            # another layout and sum in another order. What must hold: the same result to the output's rounding.
            row["bit_exact"] = bool(torch.equal(y_a, y_j) and torch.equal(st_a, st_j))
            row["y_rel_diff"] = rel_diff(y_a, y_j)
            row["state_rel_diff"] = rel_diff(st_a, st_j)
            close = row["y_rel_diff"] <= 1e-2 and row["state_rel_diff"] <= 1e-5
            row["ok"] = row["ok"] and (row["bit_exact"] or close)
        rows.append(row)
        print(f"  aot {op:18s} {k['target']}: {row}", flush=True)
    return rows


def _speed(torch, device, _time_cuda) -> list[dict]:
    """Decode steps at batch 1/8/64 and a 2048-token prefill per kernel (bfloat16, production shapes);
    ``_time_cuda(fn, iters)``: gpu_check's median seconds per call (CUDA events)."""
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    copy_s = _time_cuda(lambda: x.clone(), 10)
    copy_bw = 2 * x.numel() / copy_s
    rows = []
    for batch, label in [(1, "decode b1"), (8, "decode b8"), (64, "decode b64"), (None, "prefill 2048")]:
        rows_ = [1] * batch if batch else [2048]
        t = sum(rows_)
        for op, (fn, req, args, _, state_shape, grid) in _cases(torch, GPU_SHAPES, torch.bfloat16, device,
                                                               t).items():
            s = len(rows_)
            m = _meta(torch, device, rows=rows_, ctx=[100] * s if batch else [2048], slots=list(range(s)))
            state = torch.zeros(s, *state_shape, device=device)
            width = args[2].shape[1] if op == "gated_delta_rule" else args[0].shape[1]
            y = torch.empty(t, width, device=device, dtype=torch.bfloat16)
            g = (s, *grid[1:])
            sec = _time_cuda(lambda fn=fn, g=g, args=args, m=m, state=state, y=y, req=req:
                             fn[g](*args, *m, state, y, **req["constexprs"]), 20)
            state_bytes = 2 * state.numel() * 4
            row = {"op": op, "case": label, "us": sec * 1e6, "tokens": t}
            if batch:
                row["state_bw_frac"] = state_bytes / sec / copy_bw
            else:
                row["tok_s"] = t / sec
            rows.append(row)
            print(f"  {label:13s} {op:18s} {sec * 1e6:9.1f} us " + (f"state bw {row['state_bw_frac']:.2f}" if batch
                                                                      else f"{row['tok_s']:.0f} tok/s"), flush=True)
    return rows


def _engines(work: Path) -> list[dict]:
    """Tiny random hybrids built for this GPU in float32: greedy tokens vs transformers, graphs = eager = alone."""
    import torch  # noqa: F401

    from llmc.runtime import Engine, SamplingParams
    from llmc.testing.hybrids import PROMPTS, greedy, write_hybrid

    rows = []
    for model_type in ("qwen3_5_text", "nemotron_h", "lfm2"):
        row: dict = {"model": model_type, "ok": False}
        rows.append(row)
        try:
            hf = write_hybrid(model_type, work / model_type / "ckpt")
            refs = greedy(hf, PROMPTS[1:], 32)
            out = work / model_type / "engine"
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "llmc.cli.main", "build", str(work / model_type / "ckpt"),
                                   "--gpu", "auto", "--dtype", "float32", "-o", str(out), "-q", "--cache-dir",
                                   str(work / "cache")], capture_output=True, text=True)
            row["build_s"] = round(time.time() - t0, 1)
            if proc.returncode:
                row["error"] = f"build rc {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
                continue
            params = SamplingParams(max_tokens=32, ignore_eos=True)
            prompts = [list(p) for p in PROMPTS[1:]]
            graphs = Engine.load(out, kv_cache_tokens=4096, max_num_tokens=16, verify=False)
            got = [o.token_ids for o in graphs.generate(prompts, params)]
            row["graph_replays"] = graphs._session.graph_replays
            eager = Engine.load(out, kv_cache_tokens=4096, max_num_tokens=16, cuda_graphs=False, verify=False)
            row["equals_transformers"] = got == refs
            row["graphs_equal_eager"] = [o.token_ids for o in eager.generate(prompts, params)] == got
            row["batched_equals_single"] = all(graphs.generate([p], params)[0].token_ids == g
                                               for p, g in zip(prompts, got, strict=True))
            row["ok"] = row["equals_transformers"] and row["graphs_equal_eager"] and row["batched_equals_single"] \
                and row["graph_replays"] > 0
        except Exception as exc:  # noqa: BLE001 - one family's failure is its row's, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  engine {model_type}: {row}", flush=True)
    return rows


def run_recurrent(smoke: bool, device: str, time_cuda=None) -> dict:
    import torch

    global ROWS, CTX
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    if smoke:  # the interpreter walks every token of every program: a shorter step keeps CI's smoke run short
        ROWS, CTX = [9, 4, 1, 1, 1], [9, 20, 300, 2, 1]
    sm = 90 if smoke else (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability())
    res: dict = {"ok": False, "shapes": shapes}
    res["kernels"] = _check_kernels(torch, shapes, device, smoke)
    res["chunked"] = _chunked(torch, shapes, device)
    res["aot"] = _aot(torch, shapes, device, sm, smoke)
    ok = all(r["ok"] for part in ("kernels", "chunked", "aot") for r in res[part])
    if not smoke:
        res["speed"] = _speed(torch, device, time_cuda)
        res["engines"] = _engines(Path(tempfile.mkdtemp(prefix="llmc-hybrid-")))
        ok = ok and all(r["ok"] for r in res["engines"])
    res["ok"] = ok
    return res
