"""``llmc serve ENGINE --replicas N``: one llmc engine per Ray Serve replica, behind serve/'s own app.

* **Replicas**: the Ray Serve deployment :class:`LlmcReplica`; each replica is a Ray actor that loads
  the engine and runs serve/loop.py's ``EngineLoop`` over it (its own ORT threads: ``--threads``).
  It streams each request's per-step outputs back, reports its prefix cache (block hashes), queue
  and KV usage through ``record_routing_stats``, and fails Ray Serve's health check when its step
  loop died or stalled (Ray then replaces it).
* **Ingress**: this process. The same FastAPI app as one server (serve/app.py: validation, OpenAI
  errors, streaming, metrics, tokenization) on the same uvicorn server (serve/server.py: drain on
  SIGTERM), whose step loop is a :class:`RemoteLoop`: it sends each request to a replica through the
  deployment handle and turns the replica's stream back into the deliveries the handlers read.
  HTTP is served here, not by Ray Serve's proxy (started with ``proxy_location="Disabled"``).
* **Router**: serve/router.py, run by the deployment handle in this process.

Ray is imported only here and in serve/router.py, which only ``--replicas`` imports: the runtime and
a plain ``llmc serve`` never import Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmc.errors import LlmcError
from llmc.runtime import EngineStats, GenerationOutput, RequestOutput, SamplingParams
from llmc.runtime.tokenizer import Tokenizer
from llmc.serve.live_routers import APP_NAME, DEPLOYMENT, live_router
from llmc.serve.loop import Delivery, LoopDead, Observer, QueueFull, Snapshot
from llmc.serve.state import ServeConfig

ROUTINGS = ("prefix", "round_robin", "pow2")
log = logging.getLogger("llmc.serve")


def import_ray():
    """Ray Serve, or the one-line error naming the extra that installs it (exit code 2)."""
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise LlmcError(f"--replicas: needs Ray Serve, which is not installed here ({exc}); install it with "
                        "pip install 'llmc[ray]' (or run one server without --replicas)") from exc
    return ray


@dataclass
class ReplicaOptions:
    """How the replicas are deployed (``llmc serve`` flags)."""

    replicas: int = 2
    autoscale: tuple[int, int] | None = None  # (min, max) replicas: Ray Serve's autoscaling on ongoing requests
    routing: str = "prefix"
    ray_address: str | None = None  # None: start a local Ray instance (and stop it on exit)
    cpus_per_replica: float = 1.0  # Ray's logical CPUs each replica reserves (--threads, default 1)
    num_cpus: int | None = None  # local instance: logical CPUs (default: what the replicas reserve)
    load_kwargs: dict = field(default_factory=dict)  # Engine.load keywords of every replica
    imbalance: int = 8  # prefix routing: the most extra requests the best-matching replica may have in flight
    stats_period_s: float = 0.5  # how often replicas report their cache and queue (routing stats)
    health_check_period_s: float = 2.0
    # The Serve application's name. A process keeps one router per deployment for good (Ray Serve does not swap
    # the router class of a running handle), so another --routing in the same process needs another name.
    app_name: str = APP_NAME
    kv_events: tuple[str, int] | None = None  # --kv-events HOST, PORT: replica r publishes at PORT + 2r
    upscale_delay_s: float = 2.0  # --autoscale: how long the load must stay above target before a replica is added
    downscale_delay_s: float = 10.0  # ... and below it before one is drained and removed
    look_back_period_s: float | None = None  # the window ongoing requests are averaged over (None: Ray's default)


@dataclass
class ReplicaRequest:
    """One HTTP request's choices, sent whole to one replica (all or none are queued there)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    ids: list[str]
    block_hashes: list[int]  # the first prompt's block hashes (serve/router.py reads them)


@dataclass
class ReplicaDelivery:
    """A Delivery as it crosses from a replica: times as durations, since clocks differ between processes."""

    output: RequestOutput
    final: GenerationOutput | None
    admitted_after: float | None  # seconds from the replica receiving the request to its first scheduling


class ReplicaFailed(Exception):
    """The replica running a request died or failed before the request finished."""


class LlmcReplica:
    """One engine and its step loop, as a Ray Serve replica (deployed by :func:`deploy`)."""

    def __init__(self, engine_path: str, load_kwargs: dict, max_queue: int, stall_timeout: float,
                 kv_events: tuple[str, int] | None = None, target_itl_ms: float | None = None) -> None:
        from llmc.runtime import Engine
        from llmc.serve.loop import EngineLoop

        self.engine = Engine.load(engine_path, **load_kwargs)
        self.loop = EngineLoop(self.engine, max_queue=max_queue, stall_timeout=stall_timeout)
        self._blocks = self.engine.scheduler.blocks
        self._started = False
        self.publisher = None
        if target_itl_ms is not None:
            from llmc.serve.itl import ItlGovernor

            self.loop.after_step.append(ItlGovernor(self.engine, target_itl_ms / 1000.0))
        if kv_events is not None:  # replica r of this node: PORT + 2r, replay PORT + 2r + 1 (serve/kv_events.py)
            from ray import serve

            from llmc.serve.kv_events import attach

            rank = serve.get_replica_context().rank
            local = int(getattr(rank, "local_rank", rank))
            host, port = kv_events
            self.publisher = attach(self.loop, self.engine, host, port + 2 * local, rank=local)

    def _start(self) -> None:
        # Serve runs replica methods on one event loop of its own; the step loop posts deliveries to it.
        if not self._started:
            self._started = True
            self.loop.start(asyncio.get_running_loop())

    async def generate(self, req: ReplicaRequest):
        """Stream: one head item (``("ok", pid)`` or why the request was not queued), then ``("out", [...])``
        items of :class:`ReplicaDelivery` until every choice finished, or ``("error", why)``."""
        self._start()
        arrival = time.perf_counter()
        try:
            sink = await self.loop.submit(req.prompts, req.params, req.ids, arrival)
        except QueueFull as exc:
            yield ("queue_full", exc.waiting, exc.limit, exc.retry_after)
            return
        except LoopDead as exc:
            yield ("dead", str(exc))
            return
        except LlmcError as exc:
            yield ("refused", str(exc))
            return
        yield ("ok", os.getpid())
        left = set(req.ids)
        try:
            while left:
                batch = [await sink.get()]
                while not sink.empty():
                    batch.append(sink.get_nowait())
                out = []
                for d in batch:
                    if d.error is not None:
                        left.clear()
                        yield ("error", f"{type(d.error).__name__}: {d.error}")
                        return
                    if d.output.finished:
                        left.discard(d.output.request_id)
                    out.append(ReplicaDelivery(d.output, d.final,
                                               None if d.admitted is None else d.admitted - arrival))
                yield ("out", out)
        finally:  # the ingress cancelled the call (its client left) or the stream failed: free the engine's work
            for rid in left:
                self.loop.cancel(rid)

    def record_routing_stats(self) -> dict:
        """What routers and the ingress read (Ray Serve polls it every ``request_routing_stats_period_s``).

        Called on another thread than the step loop's: the block manager's calls are atomic under the GIL."""
        snap = self.loop.snapshot
        ok, why = self.loop.health() if self._started else (True, "ok")
        pub = self.publisher
        return {"time": time.time(), "pid": os.getpid(), "block_hashes": self._blocks.cached_hashes(),
                "kv_events": None if pub is None else pub.endpoint,
                "block_size": self.engine.block_size, "stats": snap.stats.as_dict(),
                "admitted_prompt_tokens": snap.admitted_prompt_tokens, "num_waiting": snap.num_waiting,
                "healthy": ok, "why": why}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose step loop died or stalls is replaced."""
        if self._started:
            ok, why = self.loop.health()
            if not ok:
                raise RuntimeError(why)

    def __del__(self) -> None:  # Serve drained the replica's requests (graceful_shutdown_timeout_s) before this
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()


class EngineInfo:
    """What the ingress needs of the engine without loading it: tokenizer, vocabulary, context, EOS ids."""

    def __init__(self, path: Path) -> None:
        from llmc.runtime import artifact
        from llmc.runtime.loaders.common import eos_ids as _eos_ids
        from llmc.runtime.loaders.common import max_model_len as _max_model_len

        self.path = Path(path)
        manifest = artifact.read_manifest(self.path)
        self.manifest = manifest
        self.vocab_size = int(manifest["engine"]["vocab_size"])
        self.block_size = int(manifest["kv_cache"]["block_size"])
        self.max_model_len = _max_model_len(self.path, manifest)
        self.eos_token_ids = _eos_ids(self.path)
        self.tokenizer = Tokenizer(self.path) if (self.path / "tokenizer.json").is_file() else None
        self._structured = None
        self._lock = threading.Lock()

    @property
    def structured(self):
        """Grammar compilation, to refuse a bad constraint here (400) before a replica sees it."""
        from llmc.runtime.sampling.structured import StructuredRuntime

        with self._lock:
            if self._structured is None:
                self._structured = StructuredRuntime.for_engine(self.path, self.vocab_size, self.eos_token_ids)
            return self._structured


def _sum_stats(reports: list[dict]) -> Snapshot:
    """The replicas' engine counters added up (rates recomputed from the sums)."""
    names = EngineStats.__dataclass_fields__
    total = {k: 0 for k in names}
    if reports:  # fields that are no counts (a name, a flag) as the first replica has them
        total.update({k: v for k, v in reports[0].get("stats", {}).items()
                      if k in total and not (isinstance(v, int | float) and not isinstance(v, bool))})
    for rep in reports:
        for k, v in rep.get("stats", {}).items():
            if k in total and isinstance(v, int | float) and not isinstance(v, bool):
                total[k] += v
    total["prefix_cache_hit_rate"] = (sum(r["stats"]["prefix_cache_hit_rate"] for r in reports) / len(reports)
                                      if reports else 0.0)
    total["tokens_per_s"] = total["generated_tokens"] / total["busy_seconds"] if total["busy_seconds"] else 0.0
    for k in ("spec_acceptance_rate", "spec_mean_accepted_length"):
        total[k] = 0.0
    return Snapshot(EngineStats(**total), sum(r.get("admitted_prompt_tokens", 0) for r in reports),
                    sum(r.get("num_waiting", 0) for r in reports))


@dataclass
class _InFlight:
    task: asyncio.Task
    ids: list[str]


class RemoteLoop:
    """EngineLoop's interface (serve/loop.py) over the replicas of a Ray Serve deployment.

    One HTTP request goes whole to one replica. Its outputs come back as that replica's stream; a
    replica that dies mid-request ends the request with ``ReplicaFailed`` (the handlers answer an OpenAI
    error object, in the stream or as the response), and only that replica's requests. A request that no
    replica could take (the chosen one died before accepting it) is sent once more.
    """

    def __init__(self, handle, *, block_size: int, max_queue: int, stall_timeout: float,
                 pool_tokens: int, app_name: str = APP_NAME, status_period_s: float = 1.0) -> None:
        self._handle = handle.options(stream=True)
        self.app_name = app_name
        self.block_size = block_size
        self.max_queue = max_queue
        self.stall_timeout = stall_timeout
        self.observer: Observer | None = None
        self._pool_tokens = pool_tokens
        self._status_period = status_period_s
        self._inflight: dict[str, _InFlight] = {}
        self._stopping = threading.Event()
        self._status: tuple[int, str] = (0, "no replica has reported yet")
        self._poller: threading.Thread | None = None

    # -- lifecycle and state ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._poller = threading.Thread(target=self._poll, name="llmc-replica-status", daemon=True)
        self._poller.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        for f in list(self._inflight.values()):
            f.task.cancel()
        if self._poller is not None:
            self._poller.join(timeout)

    @property
    def alive(self) -> bool:
        return not self._stopping.is_set()

    def _poll(self) -> None:
        from ray import serve

        while not self._stopping.is_set():
            try:
                app = serve.status().applications.get(self.app_name)
                dep = app.deployments.get(DEPLOYMENT) if app is not None else None
                if dep is None:
                    self._status = (0, "the replicas' deployment is not running")
                else:
                    states = {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items() if v}
                    running = states.get("RUNNING", 0)
                    self._status = (running, f"{running} replica(s) running; deployment {dep.status.value}, "
                                             f"replicas by state {states}")
            except Exception as exc:  # the controller is unreachable (Ray is shutting down)
                self._status = (0, f"cannot reach Ray Serve's controller: {type(exc).__name__}: {exc}")
            self._stopping.wait(self._status_period)

    def health(self) -> tuple[bool, str]:
        if not self.alive:
            return False, "the server is shutting down"
        running, why = self._status
        return (True, why) if running > 0 else (False, why)

    def reports(self) -> dict[str, dict]:
        """Each live replica's latest report (``LlmcReplica.record_routing_stats``), by replica id."""
        router = live_router(self.app_name)
        return {k: v for k, v in router.replica_reports().items() if v} if router is not None else {}

    @property
    def snapshot(self) -> Snapshot:
        return _sum_stats(list(self.reports().values()))

    @property
    def kv_pool_tokens(self) -> int:
        """One replica's pool (a request must fit one): the smallest reported, else what the flags ask for."""
        sizes = [r["stats"]["kv_blocks_total"] * self.block_size for r in self.reports().values()]
        return min(sizes) if sizes else self._pool_tokens

    # -- requests ------------------------------------------------------------------------------------

    async def submit(self, prompts, params, ids, arrival: float) -> asyncio.Queue[Delivery]:
        """As ``EngineLoop.submit``: queue the choices on one replica, all or none."""
        from llmc.serve.router import prompt_block_hashes

        if not self.alive:
            raise LoopDead("the server is shutting down")
        req = ReplicaRequest([list(p) for p in prompts], list(params), list(ids),
                             prompt_block_hashes(prompts[0], self.block_size))
        for attempt in range(2):
            gen = self._handle.generate.remote(req)
            try:
                head = await gen.__anext__()
                break
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as exc:  # nothing ran yet: another replica may take it
                if attempt == 1:
                    raise LoopDead(f"no replica took the request: {type(exc).__name__}: {_first_line(exc)}") from exc
                log.warning("a replica failed before taking a request (%s); sending it again", type(exc).__name__)
        if head[0] == "queue_full":
            raise QueueFull(head[1], head[2], head[3])
        if head[0] == "dead":
            raise LoopDead(head[1])
        if head[0] == "refused":
            raise LlmcError(head[1])
        sink: asyncio.Queue[Delivery] = asyncio.Queue()
        task = asyncio.ensure_future(self._pump(gen, sink, list(ids), arrival, head[1]))
        entry = _InFlight(task, list(ids))
        for rid in ids:
            self._inflight[rid] = entry
        return sink

    def cancel(self, request_id: str) -> None:
        """Cancel a request: the whole call to its replica (the handlers cancel all of a request's choices)."""
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            entry.task.cancel()

    async def _pump(self, gen, sink: asyncio.Queue, ids: list[str], arrival: float, pid: int) -> None:
        sent = time.perf_counter()
        last: dict[str, float | None] = dict.fromkeys(ids)
        obs = self.observer
        try:
            async for item in gen:
                now = time.perf_counter()
                if item[0] == "error":
                    sink.put_nowait(Delivery(None, now, None, error=ReplicaFailed(f"the replica failed: {item[1]}")))
                    return
                for rd in item[1]:
                    o = rd.output
                    admitted = None if rd.admitted_after is None else sent + rd.admitted_after
                    if obs is not None and o.request_id in last:
                        if o.new_token_ids:
                            prev = last[o.request_id]
                            if prev is None:
                                obs.first_token(now - arrival, None if admitted is None else admitted - arrival)
                            else:
                                obs.next_token(now - prev)
                            last[o.request_id] = now
                        if o.finished:
                            obs.finished(o.finish_reason or "length", now - arrival)
                    sink.put_nowait(Delivery(o, now, admitted, rd.final))
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as exc:  # the replica's actor died, or Ray lost it
            sink.put_nowait(Delivery(None, time.perf_counter(), None, error=ReplicaFailed(
                f"the replica serving this request (pid {pid}) failed mid-request ({type(exc).__name__}); the other "
                "replicas keep serving: retry the request")))
        finally:
            for rid in ids:
                if rid in self._inflight and self._inflight[rid].task is asyncio.current_task():
                    del self._inflight[rid]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


# -- deployment -------------------------------------------------------------------------------------------


def start_ray(opts: ReplicaOptions) -> bool:
    """Connect to ``--ray-address``, or start a local instance; True when this process started it."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if opts.ray_address is not None:
        try:
            ray.init(address=opts.ray_address, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise LlmcError(f"--ray-address {opts.ray_address}: cannot connect ({_first_line(exc)}); give the "
                            "address of a running Ray cluster (auto, HOST:PORT or ray://HOST:PORT), or leave the "
                            "flag out to start a local Ray instance") from exc
        return False
    most = opts.autoscale[1] if opts.autoscale else opts.replicas
    cpus = opts.num_cpus or max(1, int(round(most * opts.cpus_per_replica)))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def deploy(engine: Path, opts: ReplicaOptions, config: ServeConfig, stall_timeout: float):
    """Deploy the replicas (waits until they run); returns the deployment handle."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llmc.serve.router import ROUTERS

    if opts.routing not in ROUTERS:
        raise LlmcError(f"--routing {opts.routing}: not one of {', '.join(ROUTERS)}")
    serve.start(proxy_location="Disabled")  # this process serves HTTP (serve/server.py)
    max_num_seqs = int(opts.load_kwargs.get("max_num_seqs", 256))
    router_kwargs = {"imbalance": opts.imbalance} if opts.routing == "prefix" else {}
    router_cls = ROUTERS[opts.routing]
    scaling: dict = {"num_replicas": opts.replicas}
    if opts.autoscale is not None:
        lo, hi = opts.autoscale
        # A replica is busy when its running batch is full: scale up past half of it, so one replica never
        # queues a whole batch's worth while another could run it.
        scaling = {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
            "target_ongoing_requests": max(1, max_num_seqs // 2), "upscale_delay_s": opts.upscale_delay_s,
            "downscale_delay_s": opts.downscale_delay_s}}
        if opts.look_back_period_s is not None:
            scaling["autoscaling_config"]["look_back_period_s"] = opts.look_back_period_s
    dep = serve.deployment(
        LlmcReplica, name=DEPLOYMENT,
        # The engine answers 429 itself (--max-queue): Ray must not queue in front of it.
        max_ongoing_requests=config.max_queue + max_num_seqs,
        ray_actor_options=_actor_resources(engine, opts),
        request_router_config=RequestRouterConfig(
            request_router_class=f"{router_cls.__module__}.{router_cls.__name__}", request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=opts.stats_period_s, request_routing_stats_timeout_s=10.0),
        max_constructor_retry_count=2, health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=stall_timeout + 10,
        graceful_shutdown_timeout_s=config.drain_timeout, graceful_shutdown_wait_loop_s=0.5,
        **scaling)
    app = dep.bind(str(engine), opts.load_kwargs, config.max_queue, stall_timeout, opts.kv_events,
                   config.target_itl_ms)
    try:
        return serve.run(app, name=opts.app_name, route_prefix=None)
    except RuntimeError as exc:  # the replicas' constructor failed (Serve tried max_constructor_retry_count times)
        text = str(exc)
        why = next((ln.strip() for ln in reversed(text.splitlines()) if "Error:" in ln), _first_line(exc))
        raise LlmcError(f"--replicas: the replicas did not start: {why}") from exc


def _actor_resources(engine: Path, opts: ReplicaOptions) -> dict:
    """What one replica reserves: its CPUs, and a GPU of its own for a CUDA engine (Ray then sets the replica's
    CUDA_VISIBLE_DEVICES, so ``--device cuda`` in each replica is that GPU)."""
    from llmc.runtime import artifact

    res: dict = {"num_cpus": opts.cpus_per_replica}
    backend = artifact.read_manifest(Path(engine))["engine"].get("backend")
    if backend == "cuda" and opts.load_kwargs.get("device") in (None, "cuda"):
        res["num_gpus"] = 1
    return res


def create_replicas_app(engine: Path, opts: ReplicaOptions, config: ServeConfig):
    """Deploy the replicas and make the ingress app over them (Ray must be initialised: :func:`start_ray`)."""
    from llmc.serve.app import create_app

    info = EngineInfo(engine)
    handle = deploy(engine, opts, config, config.stall_timeout)
    kv_tokens = opts.load_kwargs.get("kv_cache_tokens") or 16384
    pool = -(-kv_tokens // info.block_size) * info.block_size
    loop = RemoteLoop(handle, block_size=info.block_size, max_queue=config.max_queue,
                      stall_timeout=config.stall_timeout, pool_tokens=pool, app_name=opts.app_name)
    return create_app(info, config, loop=loop)


def shutdown(started_ray: bool, timeout: float = 60.0) -> None:
    """Remove the replicas (each drains first), and stop Ray if this process started it.

    Bounded: when Ray itself is going away (a Ctrl-C reaches its processes too) Serve's shutdown would wait for a
    controller that is gone."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    done = threading.Thread(target=serve.shutdown, name="llmc-serve-shutdown", daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        log.warning("Ray Serve did not shut down within %.0f s; stopping anyway", timeout)
    if started_ray:
        ray.shutdown()


def serve_replicas(engine: Path, opts: ReplicaOptions, config: ServeConfig, *, sock: socket.socket | None = None,
                   log_level: str = "info") -> None:
    """``llmc serve --replicas``: deploy, serve HTTP here until SIGTERM (drains), then remove the replicas."""
    from llmc.serve.server import serve_app

    started = start_ray(opts)
    try:
        app = create_replicas_app(engine, opts, config)
        serve_app(app, config, sock=sock, log_level=log_level)
    finally:
        shutdown(started, config.drain_timeout + 15)
