"""Ahead-of-time compilation of the Triton PagedAttention kernel to PTX, for a named SM, with no GPU.

``triton.compile`` lowers :func:`~llmc.plugins.paged_attention.triton_kernel.paged_attention_kernel`
for a ``GPUTarget("cuda", sm, 32)`` (Triton's PyPI wheel bundles ``ptxas``; no CUDA toolkit or
driver is needed). The result is what TensorRT's AOT plugin interface embeds in an engine
(:mod:`.trt_plugin`): PTX text, the entry name, and the launch rule.

The launch contract (TensorRT's, for ``tensorrt.plugin.aot_impl`` kernels): the kernel's parameters
are the plugin's input pointers in order, then int32 scalars, then the output pointers. Triton
appends two hidden pointer parameters to every kernel (global and profile scratch) that TensorRT
would not pass; they are unused when their sizes are 0 (checked) and are removed from the PTX,
so the entry takes exactly the parameters below.

``query key value slot_mapping block_tables context_lens query_start_loc k_cache v_cache kv_scales``
(pointers), ``num_seqs max_blocks`` (int32), ``out k_cache_out v_cache_out`` (pointers; the cache
outputs alias the cache inputs). Grid ``(cdiv(T, block_q) + S, num_kv_heads, 1)``, ``num_warps * 32``
threads, ``shared_mem`` bytes of dynamic shared memory. ``kv_scales`` (float32 ``[2]``) is read
only by FP8 kernels but is a parameter of every kernel, so one plugin signature serves both.

Triton fixes interpreter-or-compiler for a whole process when it is imported; a process running
the interpreter (the test suite) compiles in a child process instead (:func:`compile_ptx` does it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

SUPPORTED_SMS = (80, 86, 89, 90, 100, 120)
INDEX_TYPE = "i64"  # slot_mapping, block_tables, context_lens, query_start_loc (the op schema's int64)
PARAMS = ("query", "key", "value", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
          "k_cache", "v_cache", "kv_scales", "num_seqs", "max_blocks", "out", "k_cache_out", "v_cache_out")
# Kernels with attention sinks (KernelConfig.sinks) take one more pointer after kv_scales: the float32 logits
# [num_heads]. Kernels without them keep PARAMS (their sinks_ptr is a constexpr None).
SINKS_PARAMS = (*PARAMS[:10], "sinks", *PARAMS[10:])
# Kernels with bidirectional spans (KernelConfig.attend_end) take the int64 attend_end [T] pointer next, after the
# sinks where the kernel has them, else after kv_scales (kernels without it: a constexpr None, parameters as above).
ATTEND_END_PARAM = "attend_end"
GRID_RULE = "(cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, 1)"
SHARED_MEM_LIMIT = 48 * 1024  # bytes a launch may use without cuFuncSetAttribute


@dataclass
class AotKernel:
    """One compiled specialisation. ``ptx`` is text for ``.target sm_XX`` (``sm_90a``/``sm_100a`` for
    the architecture-specific features Triton uses on Hopper/Blackwell); ``shared_mem`` bytes;
    ``block_q`` query tokens per program along grid x (see :data:`GRID_RULE`)."""

    name: str
    ptx: str
    sm: int
    target: str
    num_warps: int
    shared_mem: int
    block_q: int
    num_kv_heads: int
    params: tuple[str, ...]
    grid_rule: str
    config: dict
    triton_version: str

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    def grid(self, num_tokens: int, num_seqs: int) -> tuple[int, int, int]:
        return (-(-num_tokens // self.block_q) + num_seqs, self.num_kv_heads, 1)


def params_for(cfg) -> tuple[str, ...]:
    """The launch parameters of a kernel compiled for ``cfg``: :data:`PARAMS`, or :data:`SINKS_PARAMS` with sinks,
    with :data:`ATTEND_END_PARAM` after kv_scales / sinks when it takes attend_end."""
    params = SINKS_PARAMS if getattr(cfg, "sinks", False) else PARAMS
    if getattr(cfg, "attend_end", False):
        at = params.index("kv_scales") + 1 + int(getattr(cfg, "sinks", False))
        params = (*params[:at], ATTEND_END_PARAM, *params[at:])
    return params


def _signature(cfg) -> tuple[dict, dict]:
    act, cache = cfg.act_dtype, cfg.cache_dtype
    ptr = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "slot_ptr": INDEX_TYPE, "bt_ptr": INDEX_TYPE,
           "ctx_ptr": INDEX_TYPE, "qsl_ptr": INDEX_TYPE, "k_cache_ptr": cache, "v_cache_ptr": cache,
           "kv_scale_ptr": "fp32"}
    if cfg.sinks:
        ptr["sinks_ptr"] = "fp32"
    if cfg.attend_end:
        ptr["attend_end_ptr"] = INDEX_TYPE
    signature = {k: f"*{v}" for k, v in ptr.items()}
    signature.update(num_seqs="i32", max_blocks="i32", out_ptr=f"*{act}", k_cache_out_ptr=f"*{cache}",
                     v_cache_out_ptr=f"*{cache}")
    constexprs = {"part_m_ptr": None, "part_l_ptr": None, "part_acc_ptr": None, **cfg.constexprs()}
    if not cfg.sinks:
        constexprs["sinks_ptr"] = None
    if not cfg.attend_end:
        constexprs["attend_end_ptr"] = None
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)


def strip_hidden_params(ptx: str, name: str, visible: int) -> str:
    """Remove the parameters after the first ``visible`` ones from entry ``name``, which must be unused."""
    m = _ENTRY.search(ptx)
    if m is None or m.group(1) != name:
        raise RuntimeError(f"no .entry {name} in the PTX Triton produced")
    params = [p.strip() for p in m.group(2).split(",") if p.strip()]
    extra = params[visible:]
    if len(extra) > 2:
        raise RuntimeError(f"{name}: {len(params)} PTX parameters for {visible} kernel arguments")
    body = ptx[m.end():]
    for p in extra:
        pname = p.split()[-1]
        if re.search(rf"\b{re.escape(pname)}\b", body):
            raise RuntimeError(f"{name}: hidden parameter {pname} is used by the kernel; it cannot be dropped")
    kept = ",\n\t".join(params[:visible])
    return ptx[: m.start(2)] + "\n\t" + kept + "\n" + ptx[m.end(2):]


# Kernels are compiled without source line tables: those name the absolute path of the installed llmc and Triton,
# so one build made from two install locations (a venv, a container, a CI checkout) gave different cubins, and
# different engines. (A profiler then shows no source lines for llmc's kernels.)
NO_LINE_INFO = "TRITON_DISABLE_LINE_INFO"


def compile_env() -> dict[str, str]:
    """The environment of a child process that compiles kernels: no interpreter, no line tables."""
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, NO_LINE_INFO: "1"}


@contextlib.contextmanager
def no_line_info():
    """Compile in this process without line tables (see :data:`NO_LINE_INFO`)."""
    old = os.environ.get(NO_LINE_INFO)
    os.environ[NO_LINE_INFO] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[NO_LINE_INFO]
        else:
            os.environ[NO_LINE_INFO] = old


def _triton_compile(fn, cfg, target):
    import triton

    signature, constexprs = _signature(cfg)
    signature = {name: signature[name] for name in fn.arg_names if name in signature}  # the kernel's order
    # Every pointer is 16-byte aligned (TensorRT and torch allocations are 256-byte aligned, and
    # rows are whole heads): lets Triton vectorise loads, as its JIT does after checking.
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(signature.values()) if v.startswith("*")}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    with no_line_info():
        return triton.compile(src, target=target,
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def _compile_here(cfg, sm: int) -> AotKernel:
    import triton
    from triton.backends.compiler import GPUTarget

    from llmc.plugins.paged_attention import triton_kernel as tk

    if tk.interpreted():
        raise RuntimeError("this process runs the Triton interpreter; use compile_ptx(), which compiles in a child")
    cfg = dataclasses.replace(cfg, interpret=False, fp8_native=cfg.fp8 and sm >= 89)
    # A launch may use 48 KiB of dynamic shared memory without the per-function opt-in attribute,
    # which TensorRT's AOT launch is not documented to set: fall back to fewer pipeline stages,
    # then narrower KV tiles, until the kernel fits.
    for attempt in (cfg, dataclasses.replace(cfg, num_stages=1),
                    dataclasses.replace(cfg, num_stages=1, block_n=max(16, cfg.block_n // 2))):
        compiled = _triton_compile(tk.paged_attention_kernel, attempt, GPUTarget("cuda", sm, 32))
        cfg = attempt
        if compiled.metadata.shared <= SHARED_MEM_LIMIT:
            break
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"the kernel needs scratch memory (global {md.global_scratch_size} B, profile "
                           f"{md.profile_scratch_size} B), which a TensorRT AOT plugin cannot provide")
    params = params_for(cfg)
    ptx = strip_hidden_params(compiled.asm["ptx"], md.name, len(params))
    found = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    config = dataclasses.asdict(cfg)
    if not cfg.attend_end:  # kernels without it keep the configuration (and engine manifests) they had before it
        del config["attend_end"]
    return AotKernel(name=md.name, ptx=ptx, sm=sm, target=found.group(1) if found else "", num_warps=md.num_warps,
                     shared_mem=md.shared, block_q=cfg.block_q, num_kv_heads=cfg.num_kv_heads, params=params,
                     grid_rule=GRID_RULE, config=config, triton_version=triton.__version__)


def _needs_child() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return True
    if "triton" in sys.modules:
        from llmc.plugins.paged_attention import triton_kernel as tk

        return tk.interpreted()
    return False


def compile_ptx(cfg, sms: tuple[int, ...] | list[int]) -> list[AotKernel]:
    """Compile ``cfg`` (a :class:`~.triton_kernel.KernelConfig`, ``num_splits`` 1) for each SM in ``sms``.

    Needs no GPU. Runs in a child process when this one interprets Triton kernels.
    """
    if cfg.num_splits != 1:
        raise ValueError("ahead-of-time kernels run in one launch: num_splits must be 1")
    for sm in sms:
        if sm not in SUPPORTED_SMS:
            raise ValueError(f"sm_{sm}: not a target llmc builds kernels for ({', '.join(map(str, SUPPORTED_SMS))})")
    if not _needs_child():
        return [_compile_here(cfg, sm) for sm in sms]
    env = compile_env()
    request = json.dumps({"config": dataclasses.asdict(cfg), "sms": list(sms)})
    proc = subprocess.run([sys.executable, "-m", "llmc.plugins.paged_attention.aot", "--request", request],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time compilation failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [AotKernel(**{**k, "params": tuple(k["params"])}) for k in json.loads(proc.stdout)]


def compile_many(cfgs: list, sm: int) -> list[AotKernel]:
    """:func:`compile_ptx` for several configurations and one SM, in one child process where one is needed."""
    if sm not in SUPPORTED_SMS:
        raise ValueError(f"sm_{sm}: not a target llmc builds kernels for ({', '.join(map(str, SUPPORTED_SMS))})")
    if not cfgs:
        return []
    if not _needs_child():
        return [_compile_here(cfg, sm) for cfg in cfgs]
    env = compile_env()
    request = json.dumps({"configs": [dataclasses.asdict(c) for c in cfgs], "sms": [sm]})
    proc = subprocess.run([sys.executable, "-m", "llmc.plugins.paged_attention.aot", "--request", request],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time compilation failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [AotKernel(**{**k, "params": tuple(k["params"])}) for k in json.loads(proc.stdout)]


def assemble(ptx: str, sm: int) -> bytes:
    """Assemble PTX into a cubin with the ``ptxas`` Triton ships (a check that stripped PTX is valid)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            ptxas = get_ptxas(sm).path
        except TypeError:  # Triton releases whose get_ptxas takes no SM
            ptxas = get_ptxas().path
        proc = subprocess.run([ptxas, f"--gpu-name={sm_arch_from_capability(sm)}", src, "-o", out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas rejected the PTX for sm_{sm}: {proc.stderr[-2000:]}")
        with open(out, "rb") as f:
            return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help='JSON {"config": KernelConfig fields, "sms": [...]}')
    args = parser.parse_args(argv)
    from llmc.plugins.paged_attention.triton_kernel import KernelConfig

    request = json.loads(args.request)
    cfgs = [KernelConfig(**c) for c in request.get("configs", [request.get("config")])]
    kernels = [_compile_here(cfg, sm) for cfg in cfgs for sm in request["sms"]]
    json.dump([dataclasses.asdict(k) for k in kernels], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
