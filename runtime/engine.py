"""``Engine``: load an artifact and serve generation requests with continuous batching.

Requests are submitted to a :class:`~llmc.runtime.core.scheduler.Scheduler`; every :meth:`Engine.step`
runs one packed forward pass over the chunks the scheduler picked (decode tokens and prefill
chunks together, KV in the paged pool), samples one token for each request whose chunk reached
its last known token, and retires finished requests, returning their blocks at once.

Entry points: :meth:`Engine.generate` (a batch, to completion), :meth:`Engine.stream` (events as
tokens are produced) and :meth:`Engine.astream` (asyncio), :meth:`Engine.submit` /
:meth:`Engine.step` / :meth:`Engine.cancel` for callers that drive the loop themselves, and
:meth:`Engine.stats`. One engine serves one process; calls are serialised by a lock.

The façade delegates: loading to ``loaders`` (one loader per executor), a step to
:class:`~llmc.runtime.core.step.Stepper`, adapters to ``lora.requests``, drafts to ``speculative``, constraints
to ``sampling.structured``; streaming's text deltas to ``streaming``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import numpy as np

import llmc.runtime.artifact as artifact
from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime.core.block_manager import BlockManager
from llmc.runtime.core.kv_cache import KVPool
from llmc.runtime.core.request import Request
from llmc.runtime.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmc.runtime.core.state_cache import StatePool
from llmc.runtime.core.step import Stepper
from llmc.runtime.image_inputs import EncodedImage, ImageInputs
from llmc.runtime.loaders.common import EngineParts, LoadOptions, max_model_len
from llmc.runtime.lora import requests as lora_requests
from llmc.runtime.lora.adapter import LoraSpec
from llmc.runtime.lora.slots import LoraSlots
from llmc.runtime.outputs import EngineStats, GenerationOutput, RequestOutput, StreamEvent
from llmc.runtime.sampling.sampler import SamplingParams
from llmc.runtime.sampling.structured import StructuredConfig, StructuredRuntime
from llmc.runtime.speculative.config import SpeculativeConfig
from llmc.runtime.speculative.draft_source import DraftModel
from llmc.runtime.speculative.speculator import Speculator
from llmc.runtime.streaming import TextDeltas
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.workers.ort.session import OrtSession

Prompt = str | Sequence[int]
# Images of one prompt (paths, encoded bytes, or uint8 [H, W, 3] arrays), in the order of its image placeholders.
# an image: a file, its bytes, a decoded array [H, W, 3], or an EncodedImage (ImageInputs.prefetch: already encoded)
Images = Sequence[str | Path | bytes | np.ndarray | EncodedImage]
# Re-exported for ``from llmc.runtime import ...``: the outputs are the engine's API.
__all__ = ["Engine", "EngineStats", "GenerationOutput", "Prompt", "RequestOutput", "StreamEvent"]


class Engine:
    """A loaded engine. Create with :meth:`load`."""

    def __init__(self, path: Path, manifest: dict, session: OrtSession, pool: KVPool, blocks: BlockManager,
                 tokenizer: Tokenizer | None, eos_ids: list[int], config: SchedulerConfig,
                 state: StatePool | None = None, prefix_caching_disabled_reason: str = "") -> None:
        self.path = path
        self._state = state  # hybrid models' per-sequence state slots (None: no recurrent layers)
        self.prefix_caching_disabled_reason = prefix_caching_disabled_reason
        self.manifest = manifest
        self._session = session
        self._pool = pool
        self._blocks = blocks
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_ids
        self.config = config
        self.max_num_tokens = config.max_num_tokens
        self.block_size = pool.block_size
        self.max_model_len = max_model_len(path, manifest)
        self.vocab_size = int(manifest["engine"]["vocab_size"])
        # Whether ORT's threads spin between ops, and why (runtime/workers/ort/spin_policy.py).
        self.threads_spin: tuple[bool, str] = (session.spinning, session.spin_reason)
        # longrope engines take each token's sequence length, which selects its rotary factors.
        self._rope_lengths = "rope_lengths" in manifest["engine"].get("inputs", ())
        self.scheduler = Scheduler(config, blocks)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # cancellations to report with the next step
        self._driver: asyncio.Task | None = None
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._structured_config: StructuredConfig | None = None  # set by load(structured_config=...)
        # Multi-LoRA engines (manifest "lora"): adapters by name and the slots the graph reads (runtime/lora/).
        spec = LoraSpec.from_manifest(manifest)
        self.lora: LoraSlots | None = LoraSlots(spec) if spec is not None else None
        self.scheduler.lora = self.lora
        # How steps get the slot buffers: a CUDA session keeps them in device memory (written per adapter load),
        # ONNX Runtime reads the host arrays in place through OrtValues, anything else takes the arrays.
        lora_feed = "device" if hasattr(session, "bind_lora") else \
            "ortvalue" if isinstance(session, OrtSession) else "numpy"
        if self.lora is not None and lora_feed == "device":
            session.bind_lora(self.lora)
        # One step's work (scheduling, the worker, sampling, booking tokens): llmc.runtime.core.step.
        self._stepper = Stepper(self.scheduler, session, pool, blocks, state, self.lora, lora_feed, eos_ids,
                                tokenizer, self._rope_lengths)
        # An engine built with its vision encoder: images' processor, encoder and cache (runtime/image_inputs.py).
        device = getattr(session, "device", None)  # a CUDA session's: its encoder runs there too
        self.images: ImageInputs | None = ImageInputs.of(path, manifest, device=str(device) if device else None)
        self._stepper.images = self.images

    @property
    def speculator(self) -> Speculator | None:
        """How requests speculate (None: plain decode); set by ``load(speculative=...)`` or :meth:`set_speculator`."""
        return self._stepper.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self._stepper.speculator = speculator

    @property
    def last_schedule(self) -> SchedulerOutput | None:
        """The latest step's decisions, for inspection."""
        return self._stepper.last_schedule

    @classmethod
    def load(cls, path: str | Path, *, kv_cache_tokens: int | None = None, max_num_tokens: int = 2048,
             max_num_seqs: int = 256, max_waiting: int = 1024, enable_chunked_prefill: bool = True,
             max_prefill_tokens_with_decodes: int | None = None, enable_prefix_caching: bool = True,
             num_threads: int | None = None, attention_threads: int | None = 0,
             verify: bool = True, device: str | None = None, gpu_memory_utilization: float = 0.9,
             cuda_graphs: bool = True, speculative: SpeculativeConfig | None = None,
             structured_config: StructuredConfig | None = None,
             lora_adapters: dict[str, str | Path] | None = None, state_cache_bytes: int | None = None) -> Engine:
        """Load the artifact at ``path``.

        ``kv_cache_tokens`` sizes the KV pool (tokens across all sequences, rounded up to whole
        blocks; default 16384 for CPU engines; for CUDA engines, what fits in ``gpu_memory_utilization`` of
        the GPU's memory after the weights); ``max_num_tokens`` is the token budget of one step;
        ``max_num_seqs`` bounds the running requests and ``max_waiting`` the waiting queue.
        ``max_prefill_tokens_with_decodes`` caps the prompt tokens computed in a step that also decodes
        (bounds inter-token latency while long prompts arrive; None: the whole budget). ``num_threads``
        sizes ONNX Runtime's thread pool (default: all cores); ``attention_threads`` sets the threads of the CPU
        PagedAttention kernel, process-wide (``None`` leaves them alone): 0 (the default) runs it on that
        same ORT pool (native op, ORT >= 1.17; the Python-op route then runs it on one thread), n >= 1 on
        n OpenMP threads of its own. A separate OpenMP team competes with ORT's workers for the same
        cores: with 2 kernel threads on 2 cores a step of 8 decodes plus an 8-token prefill chunk at 2k
        context took 46 ms instead of 3.8 ms (benchmarks/bench_serving.py). With ``verify`` (default) every
        file's sha256 is checked first and a modified or missing file is refused, naming it.
        CUDA engines (manifest ``engine.backend == "cuda"``) run on ``device`` (default ``"cuda"``; ``"cpu"``
        runs the same program on torch's CPU ops, for tests) with decode steps replayed from CUDA graphs
        (``cuda_graphs``); loading one imports torch.
        Engines with length-dependent rotary factors (``longrope``; manifest ``engine.rope_recompute_at``)
        run without prefix caching, whose blocks are keyed by tokens alone.
        ``speculative`` turns on speculative decoding for every request that does not opt out
        (``SamplingParams.speculative``): see :class:`~llmc.runtime.speculative.SpeculativeConfig`; a draft
        model is loaded here, as a CPU engine with the same thread settings.
        ``structured_config`` bounds what constrained requests (``SamplingParams.structured``) may cost and
        how their masks are computed: see :class:`~llmc.runtime.sampling.structured.StructuredConfig` (None: its
        defaults).
        ``lora_adapters`` (``{name: directory}``, PEFT's format) are registered with :meth:`add_lora`, each checked
        in full here (engines built with ``--lora-slots``); requests pick one with ``SamplingParams.lora``.
        ``state_cache_bytes`` bounds a hybrid CPU engine's recurrent-state pool (default: the KV pool's size, at
        least 256 MB); fewer sequences run at once where one slot per sequence would not fit.
        """
        if structured_config is not None and not isinstance(structured_config, StructuredConfig):
            raise LlmcError(f"structured_config: must be a StructuredConfig (got {type(structured_config).__name__})")
        engine = cls._load(path, LoadOptions(
            kv_cache_tokens, max_num_tokens, max_num_seqs, max_waiting, enable_chunked_prefill,
            max_prefill_tokens_with_decodes, enable_prefix_caching, num_threads, attention_threads, verify, device,
            gpu_memory_utilization, cuda_graphs, state_cache_bytes))
        engine._structured_config = structured_config
        for name, adapter_path in (lora_adapters or {}).items():
            engine.add_lora(name, adapter_path)
        if speculative is not None and engine._state is not None:
            raise UnsupportedError(f"{engine.path}: speculative decoding: this engine's recurrent layers keep state "
                                   "that rejected draft tokens would have to be rolled back from, which llmc does not "
                                   "do yet; load it without speculative")
        if speculative is not None:
            engine.speculator = engine.new_speculator(speculative, num_threads=num_threads,
                                                      attention_threads=attention_threads, verify=verify)
        return engine

    def new_speculator(self, config: SpeculativeConfig, *, num_threads: int | None = None,
                       attention_threads: int | None = 0, verify: bool = True) -> Speculator:
        """A speculator for this engine, as ``load(speculative=config)`` makes one (method ``"draft"``: the draft
        model loaded as a CPU engine with these thread settings), for :meth:`set_speculator`."""
        draft = None
        if config.method == "draft":
            draft = Engine.load(config.draft_model, kv_cache_tokens=config.draft_kv_cache_tokens or
                                self._blocks.num_blocks * self.block_size, max_num_tokens=self.max_num_tokens,
                                num_threads=num_threads, attention_threads=attention_threads, verify=verify)
            if draft._state is not None:  # its steps run outside Engine.step, with no state slots
                raise UnsupportedError(f"{config.draft_model}: a draft model with recurrent layers (state_cache) is "
                                       "not supported yet; use a draft model without them, or method 'ngram'")
        return Speculator(config, self.vocab_size, draft)

    def set_speculator(self, speculator: Speculator | None) -> Speculator | None:
        """Change how later requests speculate (``None``: plain decode); returns the speculator it replaces.

        Only while no request is in the engine (``LlmcError`` otherwise). Each speculator keeps what it
        measured (step costs, acceptance), so swapping them back and forth compares methods on one engine:
        two engines loaded from the same files ran 2-6% apart (memory placement, measured at batch 1 on
        these 2 cores), as much as the differences such a comparison looks for.
        """
        with self._lock:
            if self.scheduler.has_work() or self._pending:
                raise LlmcError("set_speculator: requests are in the engine; wait until they finish "
                                "(has_unfinished() is False)")
            old, self.speculator = self.speculator, speculator
            if old is not None and old is not speculator:
                old.reset()  # its draft sequences: the requests they followed are gone
            return old

    @property
    def graphs(self) -> list[str]:
        """The names of the artifact's further graphs (an encoder beside the language model; llmc.runtime.graphs)."""
        from llmc.runtime.graphs import graph_entries

        return sorted(graph_entries(self.manifest))

    def graph(self, name: str, threads: int | None = None):
        """Open the artifact's further graph ``name`` as a :class:`llmc.runtime.graphs.GraphSession`."""
        from llmc.runtime.graphs import load_graph

        return load_graph(self.path, self.manifest, name, threads)

    def draft_model(self) -> DraftModel:
        """This engine's parts that speculation drives when it serves as another engine's draft model."""
        return DraftModel(self.path, self.vocab_size, self._session, self._pool, self._blocks, self._rope_lengths)

    @classmethod
    def _load(cls, path: str | Path, options: LoadOptions) -> Engine:
        """The engine at ``path``, loaded by its executor's loader (``llmc.runtime.loaders``)."""
        root = Path(path)
        manifest = artifact.require_valid(root) if options.verify else artifact.read_manifest(root)
        backend = manifest["engine"].get("backend")
        if backend in ("tensorrt", "tensorrt_rtx"):  # say what this machine lacks
            problem = artifact.load_problems(manifest)[0]
            raise UnsupportedError(f"{root / problem.file}: {problem.message}")
        if backend == "cuda":
            from llmc.runtime.loaders.cuda import load_cuda  # imports torch only for CUDA engines

            return cls._of(load_cuda(root, manifest, options))
        from llmc.runtime.loaders.ort import load_ort

        return cls._of(load_ort(root, manifest, options))

    @classmethod
    def _of(cls, p: EngineParts) -> Engine:
        return cls(p.path, p.manifest, p.session, p.pool, p.blocks, p.tokenizer, p.eos_ids, p.config, p.state,
                   p.prefix_caching_disabled_reason)

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
               images: Images | None = None) -> str:
        """Queue one request (text or token ids); returns its id. It runs as :meth:`step` is called.

        ``images`` (an engine built with its vision encoder): one per image placeholder token of the prompt, in
        order; each placeholder becomes the image's tokens (``manifest["multimodal"]``).

        Its tokens come back in the outputs of :meth:`step`; :meth:`result` returns its output so far,
        and, once it finished, returns it one last time. Raises ``LlmcError`` for a bad prompt, a
        request that could never fit in the KV pool (the message says how many blocks it needs), or
        a full waiting queue.
        """
        arrival = time.perf_counter()  # time to first token counts the encoder
        if images and self.images is not None:  # encoded here, outside the lock: steps go on meanwhile
            images = self.images.prefetch(images)
        with self._lock:
            rid = self._submit(prompt, params, request_id, "prompt", images, arrival).request_id
            self._stepper.retain.add(rid)
            return rid

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                label: str, images: Images | None = None, arrival: float | None = None) -> Request:
        params = params or SamplingParams()
        # Arrival before the images are preprocessed and encoded: time to first token counts the encoder
        arrival = time.perf_counter() if arrival is None else arrival
        lora_key = lora_requests.request_key(self.lora, self.path, params, label)
        ids = self._tokenize(prompt, label)
        spans, image_key = None, 0
        if images:
            if self.images is None:
                raise LlmcError(f"{label}: {len(images)} images, but the engine at {self.path} takes no images (a "
                                "text model, or a vision-language model built --text-only)")
            ids, spans, image_key = self.images.expand(ids, images, label)
        image_positions, position_delta = self.images.positions(len(ids), spans) if spans else (None, 0)
        atomic = self.images.atomic_spans(spans) if spans else None
        budget = self.scheduler.config.max_num_tokens
        if atomic and max(b - a for a, b in atomic) > budget:
            raise LlmcError(f"{label}: an image of {max(b - a for a, b in atomic)} tokens attends to all of its "
                            f"tokens in one step, but a step holds at most max_num_tokens={budget}; raise "
                            "max_num_tokens")
        if params.stop and self.tokenizer is None:
            raise LlmcError(f"{label}: stop strings need the engine's tokenizer.json; use stop_token_ids instead")
        if self.max_model_len and len(ids) + params.max_tokens > self.max_model_len:
            raise LlmcError(
                f"{label}: {len(ids)} prompt + {params.max_tokens} new tokens exceed the engine's context of "
                f"{self.max_model_len} tokens (max_position_embeddings); shorten the prompt or lower max_tokens"
            )
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        # Compiled here, outside the lock, so a slow constraint holds up no step; refused before it runs.
        matcher = self.structured.compiler.compile(params.structured) if params.structured is not None else None
        with self._lock:
            seq_id = next(self._ids)
            req = Request(
                request_id=request_id if request_id is not None else f"req-{seq_id}",
                seq_id=seq_id, prompt_len=len(ids), tokens=list(ids), params=params,
                arrival_time=arrival, rng=np.random.default_rng(seed),
                logprobs=[] if params.logprobs is not None else None,
                text="" if params.stop else None, lora_key=lora_key, image_spans=spans, image_key=image_key,
                image_positions=image_positions, position_delta=position_delta, atomic_spans=atomic,
            )
            if self.speculator is not None and params.speculative:
                req.spec = self.speculator.new_state()
            self.scheduler.add(req)
            if matcher is not None:
                self.structured.attach(req, matcher)
        return req

    def _tokenize(self, prompt: Prompt, label: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LlmcError(f"{self.path}: engine has no tokenizer.json; pass token ids instead of text "
                                "(llmc run ENGINE --prompt-ids 1,2,3)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise LlmcError(f"{label} is empty after tokenization; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise LlmcError(f"{label}: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def cancel(self, request_id: str) -> bool:
        """Cancel a waiting or running request; its KV blocks are returned at once.

        Returns False if no such request is in flight. Streams of the request end with a
        ``finish_reason == "cancelled"`` event.
        """
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is None:
                return False
            self._stepper.finish(req, "cancelled", time.perf_counter())
            self._pending.append(RequestOutput(request_id, [], [] if req.logprobs is not None else None, True,
                                               "cancelled"))
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or bool(self._pending)

    # -- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns what each affected request produced."""
        with self._lock:
            outputs, self._pending = self._pending, []
            return self._stepper.step(outputs)

    # -- batch ------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 *, images: list[Images | None] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids), batched continuously; outputs in order.
        ``images``: one list per prompt (None or [] for a prompt without images), see :meth:`submit`."""
        reqs = self._submit_all(prompts, params, images)
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:
            for r in reqs:
                if not r.finished:
                    self.cancel(r.request_id)
        return [self._output(r) for r in reqs]

    def _submit_all(self, prompts, params, images=None) -> list[Request]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | np.integer)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmcError(f"generate: {len(prompts)} prompts but {len(plist)} SamplingParams; pass one or one each")
        ilist = [None] * len(prompts) if images is None else list(images)
        if len(ilist) != len(prompts):
            raise LlmcError(f"generate: {len(prompts)} prompts but {len(ilist)} image lists; pass one per prompt")
        reqs: list[Request] = []
        try:
            for i, (p, sp, im) in enumerate(zip(prompts, plist, ilist, strict=True)):
                reqs.append(self._submit(p, sp, None, f"prompt {i}", im))
        except BaseException:
            for r in reqs:  # all or nothing
                self.cancel(r.request_id)
            raise
        return reqs

    def _output(self, r: Request) -> GenerationOutput:
        if r.params.stop and r.finish_reason == "stop" and r.text is not None:
            text = r.text
        else:
            text = self.tokenizer.decode(r.output_token_ids) if self.tokenizer else None
        end = r.finish_time or time.perf_counter()
        structured = self._stepper.structured
        incomplete, error = structured.outcome(r) if structured is not None else (False, None)
        return GenerationOutput(
            prompt_token_ids=r.prompt_token_ids, token_ids=r.output_token_ids, text=text,
            finish_reason=r.finish_reason or "length",
            ttft=(r.first_token_time or end) - r.arrival_time, latency=end - r.arrival_time,
            request_id=r.request_id, logprobs=r.logprobs, num_cached_tokens=r.num_cached_tokens,
            num_preemptions=r.num_preemptions, structured_incomplete=incomplete, structured_error=error,
        )

    def result(self, request_id: str) -> GenerationOutput | None:
        """The output so far of an in-flight request, or the final output of one from :meth:`submit`.

        A finished request's output is returned once and then forgotten; None for unknown ids.
        """
        with self._lock:
            r = self.scheduler.requests.get(request_id) or self._stepper.done.pop(request_id, None)
            return self._output(r) if r is not None else None

    # -- streaming --------------------------------------------------------------------------------

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               *, images: list[Images | None] | None = None) -> Iterator[StreamEvent]:
        """Yield a :class:`StreamEvent` per generated token of every prompt, as steps produce them.

        Other submitted requests keep running in the same steps. Closing the iterator early cancels
        the requests it still has in flight. ``images``: as in :meth:`generate`.
        """
        reqs = self._submit_all(prompts, params, images)
        index = {r.request_id: i for i, r in enumerate(reqs)}
        texts = TextDeltas(self.tokenizer, reqs)
        pending = set(index)
        try:
            while pending:
                for o in self.step():
                    if o.request_id in pending:
                        yield from texts.events(index[o.request_id], o)
                        if o.finished:
                            pending.discard(o.request_id)
        finally:
            for rid in pending:
                self.cancel(rid)

    async def astream(self, prompts: Prompt | list[Prompt],
                      params: SamplingParams | list[SamplingParams] | None = None) -> AsyncIterator[StreamEvent]:
        """asyncio variant of :meth:`stream`: steps run in a worker thread, shared by all concurrent streams.

        Streams started from several tasks are batched together (continuous batching); closing one
        cancels only its own requests.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        reqs = await asyncio.to_thread(self._submit_all, prompts, params)
        index = {r.request_id: i for i, r in enumerate(reqs)}
        texts = TextDeltas(self.tokenizer, reqs)
        pending = set(index)
        for rid in index:
            self._listeners[rid] = (loop, queue)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        try:
            while pending:
                o = await queue.get()
                if isinstance(o, BaseException):
                    raise o
                for ev in texts.events(index[o.request_id], o):
                    yield ev
                if o.finished:
                    pending.discard(o.request_id)
        finally:
            for rid in index:
                self._listeners.pop(rid, None)
            for rid in pending:
                self.cancel(rid)

    async def _drive(self) -> None:
        """Step while any request is in flight, handing outputs to the streams that wait for them."""
        try:
            while self.has_unfinished():
                outputs = await asyncio.to_thread(self.step)
                for o in outputs:
                    listener = self._listeners.get(o.request_id)
                    if listener is not None:
                        listener[1].put_nowait(o)
        except Exception as exc:  # surfaced to every waiting stream
            for _, q in set(self._listeners.values()):
                q.put_nowait(exc)

    # -- other ------------------------------------------------------------------------------------

    @property
    def structured(self) -> StructuredRuntime:
        """Structured outputs' state (compiled-grammar cache, matchers, mask timings); made on first use.

        Raises ``LlmcError`` if the engine has no tokenizer.json or llguidance is not installed.
        """
        with self._lock:
            if self._stepper.structured is None:
                self._stepper.structured = StructuredRuntime.for_engine(self.path, self.vocab_size,
                                                                        self.eos_token_ids, self._structured_config)
            return self._stepper.structured

    def stats(self) -> EngineStats:
        """Running/waiting requests, KV blocks, prefix-cache hit rate, preemptions and throughput."""
        with self._lock:
            b, c, st = self._blocks, self.scheduler.counters, self._stepper
            return EngineStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                kv_blocks_total=b.num_blocks, kv_blocks_used=b.num_used_blocks, kv_blocks_free=b.num_free_blocks,
                kv_blocks_cached=b.num_cached_blocks,
                prefix_cache_hit_rate=b.prefix_hits / b.prefix_queries if b.prefix_queries else 0.0,
                cached_prompt_tokens=c.cached_prompt_tokens, prompt_tokens_computed=c.prompt_tokens_computed,
                recomputed_tokens=c.recomputed_tokens, generated_tokens=st.generated,
                num_preemptions=c.num_preemptions, num_steps=c.num_steps, busy_seconds=st.busy,
                tokens_per_s=st.generated / st.busy if st.busy > 0 else 0.0,
                spec_num_draft_tokens=c.spec_draft_tokens, spec_num_accepted_tokens=c.spec_accepted_tokens,
                spec_num_verify_steps=c.spec_verify_steps,
                spec_acceptance_rate=c.spec_accepted_tokens / c.spec_draft_tokens if c.spec_draft_tokens else 0.0,
                spec_mean_accepted_length=(c.spec_accepted_tokens / c.spec_verify_steps
                                           if c.spec_verify_steps else 0.0),
                spec_draft_seconds=self.speculator.draft_seconds if self.speculator is not None else 0.0,
                **lora_requests.stats(self.lora, self.scheduler.running, self.scheduler.waiting),
                state_slots_total=self._state.num_slots if self._state is not None else 0,
                state_slots_used=self._state.num_used if self._state is not None else 0,
                state_bytes=self._state.nbytes if self._state is not None else 0,
                prefix_caching_disabled_reason=self.prefix_caching_disabled_reason,
            )

    # -- LoRA adapters ----------------------------------------------------------------------------

    def add_lora(self, name: str, path: str | Path) -> None:
        """Register the PEFT LoRA adapter in directory ``path`` as ``name`` (requests pick it with
        ``SamplingParams.lora``). The adapter is read and checked in full now: ``UnsupportedError`` (exit 3) for
        what this engine cannot run (rank above its ``--max-lora-rank``, DoRA, ``modules_to_save``, modules it has
        no slots for), ``LlmcError`` (exit 2) for a duplicate name, malformed files or shapes that do not fit.
        It takes a slot when a request for it is admitted; more adapters than slots take turns (LRU)."""
        with self._lock:
            lora_requests.require(self.lora, self.path, f"add_lora({name!r})").add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name``; ``LlmcError`` if it is unknown or requests for it are in the engine."""
        with self._lock:
            lora_requests.remove(self.lora, self.path, name, self.scheduler.requests.values())

    def lora_adapters(self) -> dict[str, Path]:
        """The registered adapters: name -> the directory it was read from (empty without LoRA slots)."""
        with self._lock:
            return {n: a.path for n, a in self.lora.adapters.items()} if self.lora is not None else {}

    def reset_prefix_cache(self) -> None:
        """Forget every cached block not in use (e.g. between benchmark runs)."""
        with self._lock:
            if self.speculator is not None:
                self.speculator.reset()
            self._blocks.reset_prefix_cache()

    def score(self, token_ids: list[int]) -> np.ndarray:
        """Logits ``[len(token_ids), vocab]`` (float32) for every position of one sequence, in one step.

        Used for perplexity and for comparing engines position by position. Runs outside the
        scheduler, with blocks of its own; raises ``LlmcError`` if the pool lacks them right now.
        """
        n = len(token_ids)
        if n == 0:
            raise LlmcError("score: token_ids is empty")
        with self._lock:
            need = -(-n // self.block_size)
            if need > self._blocks.num_free_blocks:
                raise LlmcError(f"score: {n} tokens need {need} free KV blocks, {self._blocks.num_free_blocks} "
                                "are free; raise kv_cache_tokens or score when requests have finished")
            blocks = self._blocks.allocate(need)
            try:
                p = np.arange(n, dtype=np.int64)
                table = np.asarray(blocks, np.int64)
                feeds = {
                    "input_ids": np.asarray(token_ids, np.int64),
                    "positions": p,
                    "slot_mapping": table[p // self.block_size] * self.block_size + p % self.block_size,
                    "block_tables": table[None, :],
                    "context_lens": np.asarray([n], np.int64),
                    "query_start_loc": np.asarray([0, n], np.int64),
                    "logits_indices": p,
                }
                if self._rope_lengths:
                    feeds["rope_lengths"] = np.full(n, n, np.int64)
                if self.lora is not None:  # the base model
                    self.lora.bind(feeds, [0], [n], self._stepper.lora_feed)
                if self._state is not None:  # a slot of its own; the whole sequence is this step's: a fresh state
                    feeds["state_slots"] = np.asarray([self._state.slot_of(_SCORE_SEQ)], np.int64)
                if self.images is not None:  # text only
                    feeds.update(self.images.empty(p))
                return self._session.run(feeds, self._pool, state=self._stepper.state_arrays())
            finally:
                self._blocks.free(blocks)
                if self._state is not None:
                    self._state.release(_SCORE_SEQ)


# The state slot owner of score()'s sequence (request seq_ids count up from 0).
_SCORE_SEQ = -1
