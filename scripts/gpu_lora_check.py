"""The ``lora`` section of ``scripts/gpu_check.py``: the CUDA engine's multi-LoRA kernels on a GPU.

- kernels: ``lora_shrink_kernel`` + ``lora_expand_kernel`` (llmc.plugins.lora.triton_kernels) at Llama-3-8B shapes
  (q/o: 4096 -> 4096, gate/up: 4096 -> 14336, down: 14336 -> 4096), four rank-16 slots, bfloat16 and float32, on
  steps of 1, 8 and 64 tokens whose slots mix the four adapters, "no adapter" (0) and padding (-1), against the torch
  reference (llmc.plugins.lora.reference.lora_apply); rows without an adapter must come back untouched;
- aot: each kernel compiled ahead of time for this SM (llmc.plugins.triton_aot) and launched through the CUDA driver
  as the engine launches it (llmc.runtime.workers.cuda.kernels.LoadedKernel), against the JIT kernel, bit for bit;
- speed: the pair's time per step beside the torch reference's, and the adapter bytes it reads per step (each
  token's A and B blocks) over that time as a fraction of ``bandwidth`` (the copy bandwidth section 3 measures,
  when it ran) - the kernels stream one token's slot per program, so this says how far that is from reading the
  adapters once at full speed.

``--cpu-smoke``: tiny shapes under the Triton interpreter and the AOT compilation (no launch).
"""

from __future__ import annotations

GPU_SHAPES = [("q/o 4096->4096", 4096, 4096), ("gate/up 4096->14336", 4096, 14336), ("down 14336->4096", 14336, 4096)]
SMOKE_SHAPES = [("smoke 96->130", 96, 130), ("smoke 200->64", 200, 64)]
SLOTS, RANK = 4, 16
TOL = {"fp32": dict(rtol=1e-5, atol=1e-4), "bf16": dict(rtol=2e-2, atol=2e-2)}


def _case(torch, t: int, k: int, n: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(k, SLOTS * RANK, generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(SLOTS * RANK, n, generator=g) * 0.1).to(dtype)
    s = torch.randint(-1, SLOTS + 1, (t,), generator=g, dtype=torch.int64)
    s[: min(t, SLOTS)] = torch.arange(1, min(t, SLOTS) + 1)  # every adapter present when the step is long enough
    return [v.to(device) for v in (x, y, a, b, s)]


def _run(torch, x, y, a, b, s, act: str, out=None):
    from llmc.plugins.lora import requests
    from llmc.plugins.lora.triton_kernels import lora_expand_kernel, lora_shrink_kernel

    t, k = x.shape
    n = y.shape[1]
    shrink = requests.shrink_request(k, RANK, SLOTS, act)["constexprs"]
    expand = requests.expand_request(n, RANK, SLOTS, act)["constexprs"]
    u = torch.empty(t, RANK, dtype=torch.float32, device=x.device)
    out = torch.empty_like(y) if out is None else out
    lora_shrink_kernel[(t,)](x, a, s, u, t, x.stride(0), **shrink)
    lora_expand_kernel[(t, -(-n // expand["BLOCK_N"]))](u, b, s, y, out, t, y.stride(0), **expand)
    return out, u


def _check(torch, shapes, steps, device) -> list[dict]:
    from llmc.plugins.lora.reference import lora_apply

    rows = []
    for name, k, n in shapes:
        for act, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for t in steps:
                x, y, a, b, s = _case(torch, t, k, n, dtype, device, seed=t * 7 + k + n)
                got, _ = _run(torch, x, y, a, b, s, act)
                want = lora_apply(y, x, a, b, s, RANK)
                diff = float((got.float() - want.float()).abs().max())
                none = s < 1
                row = {"shape": name, "act": act, "tokens": t, "max_abs_diff": diff,
                       "untouched": bool(torch.equal(got[none], y[none]))}
                try:
                    torch.testing.assert_close(got, want, **TOL[act])
                    row["ok"] = row["untouched"]
                except AssertionError as exc:
                    row.update(ok=False, error=str(exc)[:500])
                rows.append(row)
                print(f"  lora {name:22s} {act} t={t:<3d} max|diff| {diff:.2e} {'ok' if row['ok'] else 'FAIL'}",
                      flush=True)
    return rows


def _aot(torch, shapes, device, sm: int, smoke: bool) -> list[dict]:
    from llmc.plugins import triton_aot
    from llmc.plugins.lora import requests
    from llmc.plugins.paged_attention import aot as pa_aot

    rows = []
    for name, k, n in shapes[:2]:
        reqs = [requests.shrink_request(k, RANK, SLOTS, "bf16"), requests.expand_request(n, RANK, SLOTS, "bf16")]
        built = triton_aot.compile_requests(reqs, sm)
        row = {"shape": name, "targets": [b["target"] for b in built],
               "ok": all(b["target"].startswith(f"sm_{sm}") for b in built)}
        if not smoke:
            from llmc.runtime.workers.cuda.kernels import KernelInfo, LoadedKernel

            kernels = [LoadedKernel(KernelInfo(name=b["name"], file="", sm=sm, num_warps=b["num_warps"],
                                               shared_mem=b["shared_mem"], block_q=0, num_kv_heads=0, variant="lora",
                                               key=r["key"], config=r["constexprs"]), pa_aot.assemble(b["ptx"], sm))
                       for r, b in zip(reqs, built, strict=True)]
            t = 8
            x, y, a, b, s = _case(torch, t, k, n, torch.bfloat16, device, seed=k + n)
            want, u_j = _run(torch, x, y, a, b, s, "bf16")
            u = torch.empty(t, RANK, dtype=torch.float32, device=device)
            out = torch.empty_like(y)
            stream = torch.cuda.current_stream().cuda_stream
            kernels[0].launch((t, 1, 1), [x, a, s, u, t, x.stride(0)], stream)
            kernels[1].launch((t, -(-n // reqs[1]["constexprs"]["BLOCK_N"]), 1), [u, b, s, y, out, t, y.stride(0)],
                              stream)
            torch.cuda.synchronize()
            # Not required bit-exact: the JIT kernel is specialised on the launch's alignments, the AOT one is
            # not (see gpu_recurrent_check._aot); the same result to the outputs' rounding is.
            from gpu_recurrent_check import rel_diff

            row["bit_exact"] = bool(torch.equal(u, u_j) and torch.equal(out, want))
            row["u_rel_diff"], row["out_rel_diff"] = rel_diff(u, u_j), rel_diff(out, want)
            row["ok"] = row["ok"] and (row["bit_exact"] or (row["u_rel_diff"] <= 1e-5 and row["out_rel_diff"] <= 1e-2))
        rows.append(row)
        print(f"  lora aot {name:22s} {row}", flush=True)
    return rows


def _speed(torch, device, time_cuda, bandwidth_gbs: float | None) -> list[dict]:
    from llmc.plugins.lora.reference import lora_apply

    rows = []
    for name, k, n in GPU_SHAPES:
        for t in (1, 8, 64):
            x, y, a, b, s = _case(torch, t, k, n, torch.bfloat16, device, seed=t + k)
            out = torch.empty_like(y)
            kern = time_cuda(lambda x=x, y=y, a=a, b=b, s=s, out=out: _run(torch, x, y, a, b, s, "bf16", out), 50)
            ref = time_cuda(lambda x=x, y=y, a=a, b=b, s=s: lora_apply(y, x, a, b, s, RANK), 50)
            adapters = int((s >= 1).sum())
            read = adapters * RANK * (k + n) * 2  # each adapter row's A and B blocks, bf16, once per token
            row = {"shape": name, "tokens": t, "kernels_us": round(kern * 1e6, 1), "torch_ref_us": round(ref * 1e6, 1),
                   "adapter_bytes": read, "gbs": round(read / kern / 1e9, 1)}
            if bandwidth_gbs:
                row["of_copy_bw"] = round(row["gbs"] / bandwidth_gbs, 3)
            rows.append(row)
            print(f"  lora speed {name:22s} t={t:<3d} {row}", flush=True)
    return rows


def run_lora(smoke: bool, device: str, time_cuda=None, bandwidth_gbs: float | None = None) -> dict:
    import torch

    sm = 90 if smoke else (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability())
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    res: dict = {"slots": SLOTS, "rank": RANK}
    res["kernels"] = _check(torch, shapes, (1, 5) if smoke else (1, 8, 64), device)
    res["aot"] = _aot(torch, shapes, device, sm, smoke)
    if not smoke:
        res["speed"] = _speed(torch, device, time_cuda, bandwidth_gbs)
    res["ok"] = all(r["ok"] for part in ("kernels", "aot") for r in res[part])
    return res
