"""Where a CUDA engine's decode step spends its time: ``torch.profiler`` over a few decode steps, per kernel and
per kind of work (attention, matmul, norm, ...).

For the GPU acceptance run (scripts/gpu_check.py ``--profile``): a decode step at batch 1 reached 21% of the HBM
roofline on the last GPU run, and this says which kernels hold the rest. On a GPU the times are the kernels'
device times; on the CPU (the CUDA engine with ``device="cpu"``, as the tests run it) they are the torch ops'
self CPU times. CUDA engines only (the CPU engine runs in ONNX Runtime, which torch's profiler does not see).
Torch is imported here only when called.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

# Kinds of work, matched in order against a kernel's (lower-cased) name; the first match wins.
KINDS = [
    ("attention", r"paged_attention|attention|flash|split_kv|sdpa|fmha|combine_splits"),
    ("matmul", r"gemm|matmul|\bmm\b|aten::mm|addmm|bmm|linear|cutlass|xmma|nvjet|wgmma|int4|fp8_linear|lora"),
    ("norm", r"rms|norm"),
    ("rotary", r"rotary|rope"),
    ("elementwise", r"swiglu|silu|gelu|sigmoid|tanh|relu|mul|add|sub|div|neg|pow|exp|where"),
    ("sampling", r"argmax|topk|top_k|sort|softmax|multinomial|cumsum|sampl"),
    ("copy", r"copy|memcpy|memset|cat|index|gather|scatter|fill|to_copy|_to_|clone|contiguous|slice|view"),
]


@dataclass
class KernelTime:
    """One kernel (or torch op): ``us_per_step`` its time in one decode step, ``share`` of all kernels' time."""

    name: str
    kind: str
    calls_per_step: float
    us_per_step: float
    share: float


@dataclass
class StepProfile:
    """``steps`` decode steps of ``batch`` sequences; ``wall_ms_per_step`` measured without the profiler,
    ``kernel_ms_per_step`` the sum of the kernels' (device or CPU self) times under it; ``kinds``: ms per step."""

    device: str
    batch: int
    steps: int
    wall_ms_per_step: float
    kernel_ms_per_step: float
    kinds: dict[str, float]
    top: list[KernelTime]

    def as_dict(self) -> dict:
        return asdict(self)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def _decoding(engine, prompts: list[list[int]], params) -> list[str]:
    """Submit ``prompts`` and step until each has produced a token: every later step is a pure decode step."""
    ids = [engine.submit(p, params) for p in prompts]
    waiting = set(ids)
    while waiting:
        for out in engine.step():
            if out.new_token_ids:
                waiting.discard(out.request_id)
    return ids


def profile_decode(engine, prompts: list[list[int]], *, steps: int = 5, top: int = 25) -> StepProfile:
    """Profile ``steps`` decode steps of ``prompts`` decoding together (after two warm-up steps) on a CUDA engine.

    The requests are cancelled afterwards; the engine is left as it was (its prefix cache may hold the prompts)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmc.runtime.sampling.sampler import SamplingParams

    device = getattr(engine._session, "device", None)
    if device is None or not hasattr(engine._session, "run_device"):
        raise ValueError("profile_decode: a CUDA engine is needed (llmc build --gpu ...); a CPU engine's step runs "
                         "in ONNX Runtime, which torch's profiler does not see")
    on_gpu = torch.device(device).type == "cuda"
    params = SamplingParams(max_tokens=2 * steps + 4, ignore_eos=True)  # 2 warm-up, timed and profiled steps
    ids = _decoding(engine, prompts, params)
    try:
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)
        for _ in range(2):
            engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            sync()
    finally:
        for i in ids:
            engine.cancel(i)
        while engine.has_unfinished():
            engine.step()

    rows = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if on_gpu else ev.self_cpu_time_total
        if us > 0 and (on_gpu or not ev.key.startswith(("ProfilerStep", "[memory]"))):
            rows.append((ev.key, ev.count, us))
    total = sum(us for _, _, us in rows) or 1.0
    kinds: dict[str, float] = {}
    for name, _, us in rows:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + us / steps / 1e3
    rows.sort(key=lambda r: -r[2])
    return StepProfile(
        device=str(device), batch=len(prompts), steps=steps, wall_ms_per_step=wall * 1e3,
        kernel_ms_per_step=total / steps / 1e3,
        kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        top=[KernelTime(name=n, kind=kind_of(n), calls_per_step=c / steps, us_per_step=us / steps, share=us / total)
             for n, c, us in rows[:top]])


def format_profile(p: StepProfile) -> str:
    """A table: the kinds of work, then the top kernels, per decode step."""
    lines = [f"decode step profile: batch {p.batch}, {p.steps} steps on {p.device}: wall {p.wall_ms_per_step:.3f} ms"
             f"/step, kernels {p.kernel_ms_per_step:.3f} ms/step"]
    for kind, ms in p.kinds.items():
        lines.append(f"  {kind:11s} {ms:9.3f} ms  {ms / max(p.kernel_ms_per_step, 1e-9):6.1%}")
    lines.append(f"  {'kernel':60s} {'kind':10s} {'calls':>6s} {'us/step':>9s} {'share':>6s}")
    for k in p.top:
        lines.append(f"  {k.name[:60]:60s} {k.kind:10s} {k.calls_per_step:6.1f} {k.us_per_step:9.1f} {k.share:6.1%}")
    return "\n".join(lines)
