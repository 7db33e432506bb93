"""Tensor-parallel CUDA engines: one rank program per device, joined by torch.distributed.

An engine built with ``llmc build --gpu ... --tp N`` holds ``rank<r>/program.json`` and
``rank<r>/weights.safetensors`` for each rank (``llmc.compiler.sharding`` wrote them) and a manifest section
``parallel`` (``tensor``: N, per-rank heads and files). :class:`TensorParallelSession` is what
:class:`~llmc.runtime.engine.Engine` runs such an engine with:

- This process is rank 0: it owns the scheduler, the sampler, the tokenizer and the block tables, and runs
  rank 0's program. It starts ranks 1..N-1 as worker processes (torch.multiprocessing, ``spawn``), each with
  its own :class:`~llmc.runtime.workers.cuda.session.CudaSession` on its own device (``cuda:<r>``; with
  ``device="cpu"`` all on the CPU) and its own KV pool, which holds only that rank's KV heads.
- Ranks form process groups of their own over a ``TCPStore`` on localhost (group objects rather than the
  process-wide default group, so one process can hold several engines): a gloo group for control, over which
  rank 0 broadcasts every step's packed inputs (pickled, as ``broadcast_object_list`` does), and the group
  of the program's ``AllReduce`` nodes, which sum the row-parallel partial outputs: the same gloo group on
  the CPU, ``ProcessGroupNCCL`` on GPUs. Only rank 0's logits are read.
- A rank that dies or hangs ends the engine: rank 0 checks its workers before each step, and every
  collective has the group's timeout (``LLMC_TP_TIMEOUT`` seconds, default 30), so a step fails with
  :class:`TensorParallelError` naming the rank instead of waiting forever; the engine then refuses every
  later step with the same error.

NCCL on GPUs is coded (CUDA graphs capture the collective with the group created before capture, as vLLM
and TensorRT-LLM do) but untested: no multi-GPU machine was available. Gloo on the CPU is tested.
"""

from __future__ import annotations

import contextvars
import os
import pickle
import time
import weakref
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from llmc.errors import LlmcError
from llmc.runtime.workers.cuda import ops as torch_ops

RANK_DIR = "rank{}"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("llmc_tp_group", default=None)


class TensorParallelError(LlmcError):
    """A rank of a tensor-parallel engine died, hung or failed: the engine cannot run another step."""


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """What ``AllReduce`` computes: the sum of every rank's partial tensor (in rank order)."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _all_reduce(x: torch.Tensor, **_attrs) -> tuple[torch.Tensor]:
    """The program op: sum ``x`` over the ranks of the step being run (in place on a contiguous copy)."""
    group = _ACTIVE.get()
    if group is None:  # a single-rank run of a rank program: nothing to sum with
        return (x,)
    x = x.contiguous()
    group.allreduce([x]).wait()
    return (x,)


def all_gather_reference(parts: list[torch.Tensor], axis: int = -1) -> torch.Tensor:
    """What ``AllGather`` computes: every rank's tensor, concatenated along ``axis`` in rank order."""
    return torch.cat(parts, dim=axis)


def _all_gather(x: torch.Tensor, *, axis: int = -1, **_attrs) -> tuple[torch.Tensor]:
    """The program op: this step's ``x`` of every rank, concatenated along ``axis`` (the vocab-parallel LM head's
    logits)."""
    group = _ACTIVE.get()
    if group is None:
        return (x,)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    group.allgather([parts], [x]).wait()
    return (torch.cat(parts, dim=axis),)


# The ops exist only where ranks do: registered with the torch executor's ops when this module is imported.
torch_ops.OPS.setdefault("AllReduce", _all_reduce)
torch_ops.OPS.setdefault("AllGather", _all_gather)


_START_TIMEOUT = 120.0  # seconds a worker may take to start (import, load its weights), at least


def _timeout() -> float:
    return float(os.environ.get("LLMC_TP_TIMEOUT", "30"))


def _groups(store, rank: int, world: int, device: torch.device, timeout: float):
    """(control group, all-reduce group): the step broadcasts travel as host bytes over gloo always (NCCL moves
    device tensors only, so vLLM keeps a CPU group beside it too); the all-reduce runs on NCCL on GPUs."""
    ctl = dist.ProcessGroupGloo(dist.PrefixStore("ctl", store), rank, world, timedelta(seconds=timeout))
    if device.type != "cuda":
        return ctl, ctl
    opts = dist.ProcessGroupNCCL.Options()  # untested: no multi-GPU machine
    opts._timeout = timedelta(seconds=timeout)
    return ctl, dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)


def _rank_manifest(manifest: dict) -> dict:
    """The manifest as a rank's session reads it from ``rank<r>/``: the AOT kernels live beside the rank dirs."""
    engine = manifest["engine"]
    kernels = [{**k, "file": f"../{k['file']}"} for k in engine.get("kernels", [])]
    return {**manifest, "engine": {**engine, "kernels": kernels}}


def _root0():
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def _send(group, obj) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    group.broadcast([torch.tensor([data.numel()], dtype=torch.int64)], _root0()).wait()
    group.broadcast([data], _root0()).wait()


def _recv(group):
    size = torch.zeros(1, dtype=torch.int64)
    group.broadcast([size], _root0()).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast([data], _root0()).wait()
    return pickle.loads(data.numpy().tobytes())


def _rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else "cpu"


def _worker(rank: int, world: int, root: str, manifest: dict, device: str, port: int, timeout: float,
            cuda_graphs: bool, max_model_len: int | None) -> None:
    """Rank ``rank``'s process: join the group, then run each step rank 0 broadcasts until told to stop."""
    from llmc.runtime.workers.cuda.session import CudaSession

    dev = torch.device(_rank_device(device, rank))
    if dev.type == "cpu":  # ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=timeout))
    store.set(f"ready/{rank}", "1")
    ctl, group = _groups(store, rank, world, dev, timeout)
    session = CudaSession(Path(root) / RANK_DIR.format(rank), _rank_manifest(manifest), device=str(dev),
                          cuda_graphs=cuda_graphs, max_model_len=max_model_len)
    pool = None
    token = _ACTIVE.set(group)
    try:
        while True:
            cmd = _recv(ctl)
            if cmd[0] == "step":
                session.run_device(cmd[1], pool)
            elif cmd[0] == "copy":
                pool.copy_blocks(cmd[1])
            elif cmd[0] == "pool":
                pool = session.allocate_pool(cmd[1], cmd[2])
            elif cmd[0] == "stop":
                return
    except Exception:  # noqa: BLE001 - rank 0 went away or failed: nothing left to serve
        return
    finally:
        _ACTIVE.reset(token)


class _RankPool:
    """Rank 0's KV pool: block copies (prefix caching, preemption) happen on every rank."""

    def __init__(self, session: TensorParallelSession, inner) -> None:
        self._session, self.inner = session, inner

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._session._broadcast(("copy", list(pairs)))
        self.inner.copy_blocks(pairs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _stop(procs: list, store) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():  # a hung (or stopped) rank does not act on SIGTERM
            p.kill()
            p.join(timeout=2)
    del store


class TensorParallelSession:
    """Rank 0 of an N-rank CUDA engine; used as :class:`~llmc.runtime.workers.cuda.session.CudaSession` is."""

    def __init__(self, root: Path, manifest: dict, device: str = "cuda", cuda_graphs: bool = True,
                 max_model_len: int | None = None) -> None:
        from llmc.runtime.workers.cuda.session import CudaSession

        par = manifest["parallel"]
        self.world = int(par["tensor"])
        self.parallel = par
        self.root = Path(root)
        if torch.device(device).type == "cuda" and torch.cuda.device_count() < self.world:
            raise TensorParallelError(f"{root}: this engine runs on {self.world} GPUs (parallel.tensor = "
                                      f"{self.world}); this machine has {torch.cuda.device_count()}")
        self.timeout = _timeout()
        self._failed: str | None = None
        dev = torch.device(_rank_device(device, 0))
        store = dist.TCPStore("127.0.0.1", 0, self.world, True, timedelta(seconds=self.timeout),
                              wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = []
        for r in range(1, self.world):
            p = ctx.Process(target=_worker, daemon=True, name=f"llmc-tp-rank{r}",
                            args=(r, self.world, str(self.root), manifest, device, store.port, self.timeout,
                                  cuda_graphs, max_model_len))
            p.start()
            self.procs.append(p)
        self._finalizer = weakref.finalize(self, _stop, self.procs, store)
        self._wait_for_workers(store)
        try:
            self.ctl, self.group = _groups(store, 0, self.world, dev, self.timeout)
        except Exception as exc:  # noqa: BLE001 - a worker that never joined
            self._finalizer()
            raise TensorParallelError(f"{root}: the {self.world - 1} tensor-parallel worker(s) did not join within "
                                      f"{self.timeout:g} s ({type(exc).__name__}: {exc})") from None
        self._store = store
        self.inner = CudaSession(self.root / RANK_DIR.format(0), _rank_manifest(manifest), device=str(dev),
                                 cuda_graphs=cuda_graphs, max_model_len=max_model_len)
        self.steps = 0

    def _wait_for_workers(self, store) -> None:
        """Until every worker has started (it sets ``ready/<rank>`` before joining the group): a worker that died
        while starting is reported at once, with its exit code, instead of after the group's timeout."""
        keys = [f"ready/{r}" for r in range(1, self.world)]
        # Starting is importing torch and loading a rank's weights: it may take longer than a step's collective may
        # (LLMC_TP_TIMEOUT of a few seconds on a loaded machine), and a worker that dies is reported at once anyway.
        deadline = time.monotonic() + max(self.timeout, _START_TIMEOUT)
        while not store.check(keys):
            dead = [(r, p) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self._finalizer()
                why = (", ".join(f"rank {r} exited with code {p.exitcode} while starting" for r, p in dead) if dead
                       else f"the workers did not start within {max(self.timeout, _START_TIMEOUT):g} s")
                raise TensorParallelError(f"{self.root}: {why}; see its output above")
            time.sleep(0.05)

    # what the engine reads from a session (device, samples_on_device, sample(), host_rows(), ...)
    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _check(self) -> None:
        if self._failed:
            raise TensorParallelError(self._failed)
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._fail(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}")

    def _fail(self, why: str) -> None:
        self._failed = (f"{self.root}: {why}; this {self.world}-rank engine cannot run another step: load it again "
                        "(its requests were ended)")
        self._finalizer()
        raise TensorParallelError(self._failed)

    def _broadcast(self, cmd) -> None:
        self._check()
        try:
            _send(self.ctl, cmd)
        except RuntimeError as exc:  # gloo/NCCL (DistError): a peer closed or the timeout passed
            self._fail(self._why(exc))

    def _why(self, exc: BaseException) -> str:
        for p in self.procs:  # a peer's closed socket is seen before its process is reaped
            p.join(timeout=1.0)
        dead = [f"rank {r} (pid {p.pid}, exit code {p.exitcode})" for r, p in enumerate(self.procs, 1)
                if not p.is_alive()]
        return (f"{', '.join(dead)} died" if dead else f"a rank did not answer within {self.timeout:g} s") + \
            f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"

    # -- the session API ------------------------------------------------------------------------

    def allocate_pool(self, kv: dict, num_blocks: int) -> _RankPool:
        local = self.local_kv(kv)
        self._broadcast(("pool", local, num_blocks))
        return _RankPool(self, self.inner.allocate_pool(local, num_blocks))

    def local_kv(self, kv: dict) -> dict:
        """The KV geometry one rank stores: its own KV heads only."""
        return {**kv, "num_kv_heads": int(self.parallel["kv_heads_per_rank"])}

    def blocks_that_fit(self, kv: dict, gpu_memory_utilization: float, reserve_bytes: int) -> int:
        return self.inner.blocks_that_fit(self.local_kv(kv), gpu_memory_utilization, reserve_bytes)

    def run(self, feeds: dict[str, np.ndarray], pool: _RankPool, state=None) -> np.ndarray:
        del state  # CUDA engines keep no recurrent state
        return self.inner.host_rows(self.run_device(feeds, pool))

    def run_device(self, feeds: dict[str, np.ndarray], pool: _RankPool) -> torch.Tensor:
        self._broadcast(("step", feeds))
        token = _ACTIVE.set(self.group)
        try:
            out = self.inner.run_device(feeds, pool.inner)
        except Exception as exc:  # noqa: BLE001 - a collective inside the program failed
            if isinstance(exc, RuntimeError) and not self._failed:
                self._fail(self._why(exc))
            raise
        finally:
            _ACTIVE.reset(token)
        self.steps += 1
        return out

    def close(self) -> None:
        """Stop the workers (also done when this session is garbage collected or the process exits)."""
        if not self._failed and all(p.is_alive() for p in self.procs):
            try:
                _send(self.ctl, ("stop",))
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self._finalizer()
