"""Ahead-of-time compilation of any llmc Triton kernel to a cubin for a named SM, with no GPU.

A request names the kernel (module and function), its signature (parameter -> Triton type, or
``"constexpr"``), the constexpr values and ``num_warps``. ``triton.compile`` lowers it for
``GPUTarget("cuda", sm, 32)``; Triton's two hidden scratch parameters are checked unused and removed
from the PTX (:func:`llmc.plugins.paged_attention.aot.strip_hidden_params`), so the entry takes
exactly the kernel's non-constexpr parameters, in order; ``ptxas`` (shipped with Triton) assembles
it. The CUDA runtime launches the cubins through the driver (:mod:`llmc.runtime.workers.cuda.kernels`).

A process that runs the Triton interpreter compiles in a child process, as the paged-attention AOT
compiler does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys


def _compile_here(req: dict, sm: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    from llmc.plugins.paged_attention.aot import no_line_info, strip_hidden_params

    fn = getattr(importlib.import_module(req["module"]), req["fn"])
    signature = dict(req["signature"])
    constexprs = dict(req["constexprs"])
    divisible = set(req.get("divisible", ()))
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    with no_line_info():  # cubins the same wherever llmc is installed (paged_attention.aot.NO_LINE_INFO)
        compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options={
            "num_warps": req.get("num_warps", 4), "num_stages": req.get("num_stages", 2)})
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{req['fn']}: needs scratch memory, which an AOT launch does not provide")
    visible = sum(1 for t in signature.values() if t != "constexpr")
    ptx = strip_hidden_params(compiled.asm["ptx"], md.name, visible)
    found = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    return {"name": md.name, "ptx": ptx, "shared_mem": md.shared, "num_warps": md.num_warps,
            "target": found.group(1) if found else "", "triton_version": triton.__version__}


def compile_requests(requests: list[dict], sm: int) -> list[dict]:
    """Compile every request for ``sm``; each result: ``name``, ``ptx``, ``shared_mem``, ``num_warps``, ``target``."""
    from llmc.plugins.paged_attention.aot import _needs_child, compile_env

    if not requests:
        return []
    if not _needs_child():
        return [_compile_here(r, sm) for r in requests]
    env = compile_env()
    proc = subprocess.run([sys.executable, "-m", "llmc.plugins.triton_aot", "--sm", str(sm)],
                          input=json.dumps(requests), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time compilation failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm", type=int, required=True)
    args = parser.parse_args(argv)
    requests = json.loads(sys.stdin.read())
    json.dump([_compile_here(r, args.sm) for r in requests], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
