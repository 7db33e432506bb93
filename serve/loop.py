"""The engine's step loop, on a thread of its own, so the event loop keeps answering while a step computes.

Only this thread touches the engine: handlers hand it submissions and cancellations through an
inbox, and it hands each request's outputs back to the event loop (one callback per step). So the
event loop never waits on the engine's lock, which a step holds for its whole forward pass.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmc.runtime import Engine, EngineStats, GenerationOutput, RequestOutput, SamplingParams


class QueueFull(Exception):
    """The waiting queue has no room for the request's choices (answered with 429).

    ``retry_after`` (seconds, None if unknown): how long until the queue has drained enough room for the
    request at the rate requests finished recently (:func:`drain_seconds`)."""

    def __init__(self, waiting: int, limit: int, retry_after: float | None = None) -> None:
        super().__init__(f"the waiting queue is full ({waiting} requests waiting, --max-queue {limit})")
        self.waiting = waiting
        self.limit = limit
        self.retry_after = retry_after


RATE_WINDOW_S = 30.0  # completions older than this do not count towards the drain rate


def drain_seconds(finish_times: Sequence[float], now: float, needed: int) -> float | None:
    """Seconds until ``needed`` more requests finish at the rate of ``finish_times`` (monotonic seconds) in the
    last :data:`RATE_WINDOW_S`; None when fewer than two finished there (no rate to go on)."""
    recent = [t for t in finish_times if now - t <= RATE_WINDOW_S]
    if len(recent) < 2:
        return None
    span = max(now - recent[0], 1e-3)
    # The first completion opens the span: the n - 1 after it are what happened within it (n / span overstated
    # the rate by n / (n - 1): 7 % with 15 completions in the window, which the test's random rate could hit).
    return needed / ((len(recent) - 1) / span)


class LoopDead(Exception):
    """The step loop stopped (the server is shutting down, or a step raised)."""


@dataclass
class Delivery:
    """One request's output of one step, with the times the server's metrics need (``time.perf_counter``)."""

    output: RequestOutput | None  # None: the loop died; see error
    time: float  # end of the step that produced it
    admitted: float | None  # start of the step that first scheduled the request
    final: GenerationOutput | None = None  # the whole output, with the last token
    error: BaseException | None = None


@dataclass
class Snapshot:
    """Engine counters read by the loop thread between steps, for /metrics and back-pressure."""

    stats: EngineStats
    admitted_prompt_tokens: int  # prompt tokens looked up in the prefix cache (first admissions)
    num_waiting: int


class Observer(Protocol):
    """Receives each request's latencies (seconds) from the loop thread: the server's metrics."""

    def first_token(self, ttft: float, queue_time: float | None) -> None: ...
    def next_token(self, itl: float) -> None: ...
    def finished(self, reason: str, e2e: float) -> None: ...


@dataclass
class _Submit:
    prompts: Sequence[list[int]]
    params: Sequence[SamplingParams]
    ids: Sequence[str]
    sink: asyncio.Queue
    arrival: float
    future: concurrent.futures.Future
    images: Sequence | None = None  # per prompt: its decoded images (Engine.submit's images), or None


@dataclass
class _Tracked:
    sink: asyncio.Queue
    arrival: float  # when the HTTP request arrived (perf_counter)
    admitted: float | None = None
    last: float | None = None  # time of the latest token


class EngineLoop:
    """Runs ``engine.step()`` while requests are in flight; see the module docstring."""

    def __init__(self, engine: Engine, *, max_queue: int, stall_timeout: float = 60.0,
                 observer: Observer | None = None) -> None:
        self.engine = engine
        # The engine refuses submissions past its own max_waiting with a plain error; stay under it.
        self.max_queue = min(max_queue, engine.config.max_waiting)
        self.stall_timeout = stall_timeout
        self._inbox: collections.deque[_Submit | str] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._observer = observer
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None
        self._beat = time.monotonic()
        # Monotonic times requests finished: the drain rate behind a 429's Retry-After.
        self._finish_times: collections.deque[float] = collections.deque(maxlen=4096)
        self.error: BaseException | None = None
        # Called on this thread after every step with its seconds (serve/kv_events.py publishes the step's cache
        # changes; serve/itl.py sizes the next step's prompt share).
        self.after_step: list[Callable[[float], None]] = []
        self.snapshot = self._snapshot()

    # -- event-loop side ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="llmc-step-loop", daemon=True)
        self._thread.start()

    async def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                     ids: Sequence[str], arrival: float, images: Sequence | None = None) -> asyncio.Queue[Delivery]:
        """Queue the requests, all or none; returns the queue that receives all their deliveries.

        ``arrival`` (``time.perf_counter()``) starts the latency clocks; ``images``: one list per prompt
        (``Engine.submit``'s, encoded on this loop's thread as the request is queued). Raises ``QueueFull``,
        ``LlmcError`` (a request the engine refuses) or ``LoopDead``.
        """
        if not self.alive:
            raise LoopDead(self._dead_reason())
        sink: asyncio.Queue[Delivery] = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append(_Submit(prompts, params, ids, sink, arrival, fut, images))
        self._wake.set()
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The handler is going away. A submission still in the inbox was cancelled with it (the loop
            # skips it); one the loop had taken already is cancelled as soon as it is in.
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or [self.cancel(i) for i in ids])
            raise
        return sink

    def cancel(self, request_id: str) -> None:
        """Cancel a request (thread-safe, returns at once); its blocks are freed before the next step."""
        self._inbox.append(request_id)
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still in flight and end the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._refuse_inbox()  # what was submitted while the thread was ending

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the engine's KV pool holds (no engine lock taken)."""
        return self.snapshot.stats.kv_blocks_total * self.engine.block_size

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stopping

    def health(self) -> tuple[bool, str]:
        """(ok, why): not ok when the thread is dead or one step has run longer than ``stall_timeout``."""
        if not self.alive:
            return False, self._dead_reason()
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_timeout:
            return False, f"one engine step has run for {time.monotonic() - started:.1f} s (> {self.stall_timeout} s)"
        if time.monotonic() - self._beat > self.stall_timeout + 5:
            return False, "the step loop has not turned for over the stall timeout"
        return True, "ok"

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine's step loop died: {type(self.error).__name__}: {self.error}"
        return "the engine's step loop is not running (the server is starting or shutting down)"

    # -- loop thread ----------------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        sched = self.engine.scheduler
        return Snapshot(self.engine.stats(), sched.counters.admitted_prompt_tokens, len(sched.waiting))

    def _run(self) -> None:
        engine = self.engine
        last_schedule = engine.last_schedule
        try:
            while not self._stopping:
                self._beat = time.monotonic()
                self._wake.clear()
                self._drain_inbox()
                if not engine.has_unfinished():
                    self.snapshot = self._snapshot()
                    self._wake.wait(0.5)
                    continue
                t0 = time.perf_counter()
                self._step_started = time.monotonic()
                outputs = engine.step()
                self._step_started = None
                now = time.perf_counter()
                if engine.last_schedule is not last_schedule:
                    last_schedule = engine.last_schedule
                    for r in last_schedule.admitted:
                        t = self._tracked.get(r.request_id)
                        if t is not None and t.admitted is None:
                            t.admitted = t0
                self._deliver(outputs, now)
                self.snapshot = self._snapshot()
                for hook in self.after_step:
                    hook(now - t0)
        except Exception as exc:  # a bug or a broken engine: every waiting handler gets a 500
            self._step_started = None
            self.error = exc
            self._fail_all(exc)
            return
        self._shutdown()

    def _drain_inbox(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, str):
                if cmd in self._tracked:
                    self.engine.cancel(cmd)
            else:
                self._submit(cmd)

    def _submit(self, cmd: _Submit) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the handler was cancelled while this waited in the inbox (its client left): submit nothing
        waiting = len(self.engine.scheduler.waiting)
        if waiting + len(cmd.ids) > self.max_queue:
            needed = waiting + len(cmd.ids) - self.max_queue
            cmd.future.set_exception(QueueFull(waiting, self.max_queue,
                                               drain_seconds(self._finish_times, time.monotonic(), needed)))
            return
        done: list[str] = []
        try:
            images = cmd.images or [None] * len(cmd.ids)
            for prompt, params, rid, im in zip(cmd.prompts, cmd.params, cmd.ids, images, strict=True):
                self.engine.submit(prompt, params, request_id=rid, **({"images": im} if im else {}))
                done.append(rid)
        except Exception as exc:  # LlmcError: the engine refused the request (400); anything else is a bug (500)
            for rid in done:  # all or nothing
                self.engine.cancel(rid)
                self.engine.result(rid)
            cmd.future.set_exception(exc)
            return
        for rid in cmd.ids:
            self._tracked[rid] = _Tracked(cmd.sink, cmd.arrival)
        cmd.future.set_result(None)

    def _refuse_inbox(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, _Submit) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(LoopDead(self._dead_reason()))

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        batch: list[tuple[asyncio.Queue, Delivery]] = []
        obs = self._observer
        for o in outputs:
            t = self._tracked.pop(o.request_id, None) if o.finished else self._tracked.get(o.request_id)
            final = self.engine.result(o.request_id) if o.finished else None  # also drops the engine's record
            if o.finished:
                self._finish_times.append(time.monotonic())
            if t is None:
                continue
            if obs is not None:
                if o.new_token_ids:
                    if t.last is None:
                        obs.first_token(now - t.arrival, None if t.admitted is None else t.admitted - t.arrival)
                    else:
                        obs.next_token(now - t.last)
                    t.last = now
                if o.finished:
                    obs.finished(o.finish_reason or "length", now - t.arrival)
            batch.append((t.sink, Delivery(o, now, t.admitted, final)))
        if batch:
            self._post(batch)

    def _post(self, batch: list[tuple[asyncio.Queue, Delivery]]) -> None:
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, exc: BaseException) -> None:
        self._refuse_inbox()
        now = time.perf_counter()
        sinks = {id(t.sink): t.sink for t in self._tracked.values()}
        batch = [(sink, Delivery(None, now, None, error=exc)) for sink in sinks.values()]
        self._tracked.clear()
        if batch:
            self._post(batch)

    def _shutdown(self) -> None:
        """Stopping: refuse what is queued, cancel what runs (the server drained what it could)."""
        self._refuse_inbox()
        for rid in list(self._tracked):
            self.engine.cancel(rid)
        self._deliver(self.engine.step() if self.engine.has_unfinished() else [], time.perf_counter())
        self.snapshot = self._snapshot()


def _put_all(batch: list[tuple[asyncio.Queue, Delivery]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
