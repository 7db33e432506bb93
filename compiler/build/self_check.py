"""The build's architecture self-check (compiler/selfcheck.py): started beside tracing in a second process, joined
before anything is emitted. ``build`` is passed in (the twin is built by the same driver), so this module imports
no driver."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llmc.build_cache import Store, sources_digest
from llmc.compiler import artifact
from llmc.compiler.build.options import canonical_recipe
from llmc.compiler.build.plan import Plan
from llmc.compiler.checkpoint import Checkpoint
from llmc.errors import LlmcError, UnsupportedError
from llmc.quant.recipe import QuantRecipe

Progress = Callable[[str], None]
BuildFn = Callable[..., object]


def package_root() -> Path:
    import llmc

    return Path(llmc.__file__).resolve().parent


def enabled(plan: Plan) -> bool:
    """LLMC_SELF_CHECK=0 skips it (the test suite does, except where it tests the check: thousands of option
    combinations would each pay for a twin); a user's build always runs it."""
    return plan.options.self_check and os.environ.get("LLMC_SELF_CHECK", "1") != "0"


def run(ckpt: Checkpoint, plan: Plan, say: Progress, build: BuildFn, lookup_only: bool = False):
    """The architecture self-check for this build (see compiler/selfcheck.py); raises UnsupportedError on a mismatch.

    The twin is built unquantized, in float32, for the same target where the runtime here can execute it
    (the CPU, or a CUDA engine on torch's CPU ops); a TensorRT export's twin is checked as a CPU engine (its
    graph is the same up to the TensorRT lowering).
    """
    from llmc.compiler import selfcheck
    from llmc.compiler.vision_encoder import needs_tokenizer

    options, target = plan.options, plan.target
    cuda = plan.backend.name == "cuda"
    twin_options = dataclasses.replace(
        options, target=target.name if cuda or target.sm is None else "cpu", quant=QuantRecipe(),
        max_ppl_increase=None, force=True, verify_passes=False, self_check=False, aot_kernels=False,
        dtype="float32", lora_slots=0, tp=1,  # the twin checks the architecture; tests/test_lora.py the LoRA slots
        mxfp4_activations="float32")  # a twin has no MXFP4 experts (tests/test_prequantized_mxfp4.py: the Q8 op)
    if needs_tokenizer(ckpt.model_type):
        # the image layout's tokens are named by a tokenizer a random twin has not;
        twin_options = dataclasses.replace(twin_options, text_only=True)  # the twin compares text tokens anyway
    lowering = {k: v for k, v in canonical_recipe(twin_options).items() if k not in ("quant",)}

    def build_twin(twin_ckpt: Path, out: Path, **overrides) -> None:
        # overrides: the diagnosis's variants of the same build (verified passes, fusions off)
        if "disabled_passes" in overrides:
            overrides["disabled_passes"] = (*twin_options.disabled_passes, *overrides["disabled_passes"])
        build(twin_ckpt, out, dataclasses.replace(twin_options, **overrides))

    return selfcheck.run(ckpt.config, ckpt.model_type, build_twin, lowering, artifact.toolchain_versions(),
                         sources_digest(package_root()), plan.cache_root or Store(None).root, cuda,
                         cacheable=not options.extra_passes, say=say, lookup_only=lookup_only)


def child(ckpt: Checkpoint, plan: Plan, build: BuildFn) -> tuple[str, object]:
    """The self-check in a worker process: ("ok", SelfCheckResult), ("refused", message) (exit 3), ("error",
    (message, exit code)) (another LlmcError: transformers rejects the config) or ("bug", message) (a twin
    transformers cannot run: compiler/twin_fault.py)."""
    from llmc.compiler.twin_fault import TwinBug

    try:
        return "ok", run(ckpt, plan, lambda _msg: None, build)
    except UnsupportedError as exc:
        return "refused", str(exc)
    except LlmcError as exc:
        return "error", (str(exc), exc.exit_code)
    except TwinBug as exc:
        return "bug", str(exc)


class PendingSelfCheck:
    """The self-check running beside the build, in a second Python process (``python -m
    llmc.compiler.selfcheck_worker``: a twin's tracing is single-threaded Python like the real build's, so on
    two cores it costs little wall time; a plain subprocess, not multiprocessing, so a caller's script is never
    re-imported), or in this process when the result is cached, the build does not pickle (a test-only pass
    made in a closure), or the worker dies without an answer."""

    def __init__(self, result=None, proc=None, files=None, args=None):
        self._result, self._proc, self._files, self._args = result, proc, files, args

    @classmethod
    def start(cls, ckpt: Checkpoint, plan: Plan, say: Progress, build: BuildFn) -> PendingSelfCheck:
        import pickle
        import subprocess
        import sys

        cached = run(ckpt, plan, say, build, lookup_only=True)
        if cached is not None:
            return cls(result=cached)
        try:
            blob = pickle.dumps((ckpt, plan))
        except Exception:  # noqa: BLE001 - e.g. a test-only pass defined in a closure: check in this process
            return cls(result=run(ckpt, plan, say, build))
        say(f"      self-check: a random twin of this {ckpt.model_type} config through the same pipeline, "
            "against transformers (in a second process, beside the build)")
        from llmc.compiler.selfcheck import SCRATCH_PREFIX, mark_scratch

        work = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX + "job-"))
        mark_scratch(work)
        (work / "in.pkl").write_bytes(blob)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the caller's modules
        with open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "llmc.compiler.selfcheck_worker", str(work)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        return cls(proc=proc, files=work, args=(ckpt, plan, say, build))

    def cancel(self) -> None:
        """Stop the worker (the build failed or was interrupted first)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._files is not None:
            shutil.rmtree(self._files, ignore_errors=True)

    def result(self):
        if self._proc is None:
            return self._result
        import pickle

        try:
            self._proc.wait()
            out = self._files / "out.pkl"
            if self._proc.returncode != 0 or not out.is_file():
                tail = (self._files / "stderr.txt").read_text(errors="replace")[-2000:]
                logging.getLogger("llmc").debug("self-check worker exited %s without an answer: %s",
                                                self._proc.returncode, tail)
                return run(*self._args)  # the check is not optional: run it here
            status, payload = pickle.loads(out.read_bytes())
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            shutil.rmtree(self._files, ignore_errors=True)
        if status == "refused":
            raise UnsupportedError(payload)
        if status == "error":
            raise LlmcError(payload[0], exit_code=payload[1])
        if status == "bug":
            from llmc.compiler.twin_fault import TwinBug

            raise TwinBug(payload)
        return payload
