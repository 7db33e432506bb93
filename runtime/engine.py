"""``Engine``: load an artifact and serve generation requests with continuous batching.

Requests are submitted to a :class:`~llmc.runtime.scheduler.Scheduler`; every :meth:`Engine.step`
runs one packed forward pass over the chunks the scheduler picked (decode tokens and prefill
chunks together, KV in the paged pool), samples one token for each request whose chunk reached
its last known token, and retires finished requests, returning their blocks at once.

Entry points: :meth:`Engine.generate` (a batch, to completion), :meth:`Engine.stream` (events as
tokens are produced) and :meth:`Engine.astream` (asyncio), :meth:`Engine.submit` /
:meth:`Engine.step` / :meth:`Engine.cancel` for callers that drive the loop themselves, and
:meth:`Engine.stats`. One engine serves one process; calls are serialised by a lock.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime import artifact
from llmc.runtime.kv_cache import BlockManager, KVPool
from llmc.runtime.lora import LoraSlots, LoraSpec
from llmc.runtime.sampler import SampleRow, SamplingParams, sample, token_logprobs
from llmc.runtime.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from llmc.runtime.session import OrtSession, custom_ops_of
from llmc.runtime.speculative import SpeculativeConfig, Speculator
from llmc.runtime.state_cache import NO_PREFIX_CACHING, StatePool
from llmc.runtime.structured import StructuredConfig, StructuredRuntime
from llmc.runtime.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass
class GenerationOutput:
    """One finished request. Times in seconds from submission; ``ttft`` is time to first token.

    ``logprobs`` (when requested) has one ``{token_id: logprob}`` per output token, holding the
    chosen token and the requested number of most likely ones.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    ttft: float = 0.0
    latency: float = 0.0
    request_id: str = ""
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Structured outputs (SamplingParams.structured): the output stopped before its structure was
    # complete (by max_tokens, a stop string, cancellation), or the constraint failed (then why).
    structured_incomplete: bool = False
    structured_error: str | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token (if any) and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None


@dataclass
class StreamEvent:
    """One streamed token of request ``index`` (position in the prompts given to stream()).

    The last event of a request has ``finished`` set (a cancelled request's last event carries
    no token). ``text`` is the new text this token adds (``None`` without a tokenizer).
    """

    index: int
    request_id: str
    token_id: int | None
    text: str | None
    logprobs: dict[int, float] | None
    finished: bool
    finish_reason: str | None


@dataclass
class EngineStats:
    """A snapshot of the engine. Block counts are KV blocks of ``block_size`` tokens."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int  # free plus cached-but-unused (evictable) blocks
    kv_blocks_cached: int  # blocks registered in the prefix cache
    prefix_cache_hit_rate: float  # hit blocks / looked-up full prompt blocks
    cached_prompt_tokens: int  # prompt tokens served by the prefix cache
    prompt_tokens_computed: int
    recomputed_tokens: int
    generated_tokens: int
    num_preemptions: int
    num_steps: int
    busy_seconds: float  # time spent in steps
    tokens_per_s: float  # generated tokens per busy second
    # Speculative decoding (zeros without it): draft tokens verified, of which accepted, verify chunks;
    # acceptance rate = accepted / draft; mean accepted length = accepted / verify chunks (the target's own
    # token per chunk not counted); draft_seconds = time in the draft model's steps.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_draft_seconds: float = 0.0
    # Multi-LoRA engines: adapters that running requests use, adapters that waiting requests ask for, and the
    # engine's slots (0: no LoRA); vLLM's lora_requests_info gauge reports them.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # Hybrid models (recurrent layers): per-sequence state slots beside the KV blocks, and their memory.
    state_slots_total: int = 0
    state_slots_used: int = 0
    state_bytes: int = 0
    # Why prefix caching is off although it was asked for ("" when it is on or was turned off by the caller).
    prefix_caching_disabled_reason: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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
        self.max_model_len = _max_model_len(path, manifest)
        self.vocab_size = int(manifest["engine"]["vocab_size"])
        # Whether ORT's threads spin between ops, and why (runtime/spin_policy.py).
        self.threads_spin: tuple[bool, str] = (session.spinning, session.spin_reason)
        # longrope engines take each token's sequence length, which selects its rotary factors.
        self._rope_lengths = "rope_lengths" in manifest["engine"].get("inputs", ())
        self.scheduler = Scheduler(config, blocks)
        self.last_schedule: SchedulerOutput | None = None  # the latest step's decisions, for inspection
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # cancellations to report with the next step
        self._retain: set[str] = set()  # ids from submit(): kept when finished until result() reads them
        self._done: dict[str, Request] = {}
        self._busy = 0.0
        self._generated = 0
        self._driver: asyncio.Task | None = None
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.speculator: Speculator | None = None  # set by load(speculative=...)
        self._structured: StructuredRuntime | None = None  # made by the first constrained request
        self._structured_config: StructuredConfig | None = None  # set by load(structured_config=...)
        # Multi-LoRA engines (manifest "lora"): adapters by name and the slots the graph reads (runtime/lora.py).
        spec = LoraSpec.from_manifest(manifest)
        self.lora: LoraSlots | None = LoraSlots(spec) if spec is not None else None
        self.scheduler.lora = self.lora
        # How steps get the slot buffers: a CUDA session keeps them in device memory (written per adapter load),
        # ONNX Runtime reads the host arrays in place through OrtValues, anything else takes the arrays.
        self._lora_feed = "device" if hasattr(session, "bind_lora") else \
            "ortvalue" if isinstance(session, OrtSession) else "numpy"
        if self.lora is not None and self._lora_feed == "device":
            session.bind_lora(self.lora)

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
        how their masks are computed: see :class:`~llmc.runtime.structured.StructuredConfig` (None: its defaults).
        ``lora_adapters`` (``{name: directory}``, PEFT's format) are registered with :meth:`add_lora`, each checked
        in full here (engines built with ``--lora-slots``); requests pick one with ``SamplingParams.lora``.
        ``state_cache_bytes`` bounds a hybrid CPU engine's recurrent-state pool (default: the KV pool's size, at
        least 256 MB); fewer sequences run at once where one slot per sequence would not fit.
        """
        if structured_config is not None and not isinstance(structured_config, StructuredConfig):
            raise LlmcError(f"structured_config: must be a StructuredConfig (got {type(structured_config).__name__})")
        engine = cls._load(path, kv_cache_tokens, max_num_tokens, max_num_seqs, max_waiting, enable_chunked_prefill,
                           max_prefill_tokens_with_decodes, enable_prefix_caching, num_threads, attention_threads,
                           verify, device, gpu_memory_utilization, cuda_graphs, state_cache_bytes)
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

    @classmethod
    def _load(cls, path, kv_cache_tokens, max_num_tokens, max_num_seqs, max_waiting, enable_chunked_prefill,
              max_prefill_tokens_with_decodes, enable_prefix_caching, num_threads, attention_threads, verify, device,
              gpu_memory_utilization, cuda_graphs, state_cache_bytes=None) -> Engine:
        root = Path(path)
        manifest = artifact.require_valid(root) if verify else artifact.read_manifest(root)
        engine_info, kv = manifest["engine"], manifest["kv_cache"]
        if engine_info.get("backend") in ("tensorrt", "tensorrt_rtx"):  # say what this machine lacks
            problem = artifact.load_problems(manifest)[0]
            raise UnsupportedError(f"{root / problem.file}: {problem.message}")
        if engine_info.get("backend") == "cuda":
            return cls._load_cuda(root, manifest, kv_cache_tokens, config_args=dict(
                max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                enable_chunked_prefill=enable_chunked_prefill,
                max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                enable_prefix_caching=enable_prefix_caching and engine_info.get("rope_recompute_at") is None,
                rope_recompute_at=engine_info.get("rope_recompute_at")),
                device=device or "cuda", gpu_memory_utilization=gpu_memory_utilization, cuda_graphs=cuda_graphs)
        if device not in (None, "cpu"):
            raise LlmcError(f"{root / artifact.MANIFEST}: device {device!r}: this is a CPU engine (backend "
                            f"{engine_info.get('backend')!r}); build with --gpu to run on a GPU")
        if kv_cache_tokens is None:
            kv_cache_tokens = 16384
        if engine_info.get("backend") != "onnxruntime":
            raise LlmcError(
                f"{root / artifact.MANIFEST}: engine backend {engine_info.get('backend')!r} cannot run on this "
                "machine (this runtime runs 'onnxruntime' CPU engines); build with --target cpu"
            )
        rope_at = engine_info.get("rope_recompute_at")
        enable_prefix_caching = enable_prefix_caching and rope_at is None
        hybrid = manifest.get("state_cache")
        no_prefix = ""
        if hybrid and enable_prefix_caching:
            no_prefix = NO_PREFIX_CACHING
            enable_prefix_caching = False
            import logging

            logging.getLogger("llmc").info("%s: prefix caching is off: %s", root, no_prefix)
        config = SchedulerConfig(max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                 enable_chunked_prefill=enable_chunked_prefill,
                                 max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
                                 enable_prefix_caching=enable_prefix_caching, rope_recompute_at=rope_at)
        session = OrtSession(root / engine_info["model_file"], num_threads=num_threads or os.cpu_count(),
                             custom_ops=custom_ops_of(manifest))
        if attention_threads is not None:
            session.set_attention_threads(int(attention_threads))
        block_size = int(kv["block_size"])
        num_blocks = max(1, -(-kv_cache_tokens // block_size))
        pool = KVPool.allocate(kv["num_layers"], num_blocks, kv["num_kv_heads"], block_size, kv["head_size"],
                               kv["dtype"], kv.get("layers"))
        tokenizer = Tokenizer(root) if (root / "tokenizer.json").is_file() else None
        blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        state = None
        if hybrid:
            # One state slot per running sequence, and one for score(); at most as much state as the KV pool holds
            # (and at least STATE_MIN_BYTES' worth), fewer running sequences if need be.
            per_slot = StatePool.bytes_per_slot(hybrid)
            budget = state_cache_bytes
            if budget is None:
                budget = max(STATE_MIN_BYTES, KVPool.bytes_per_block(
                    kv["num_layers"], kv["num_kv_heads"], block_size, kv["head_size"], kv["dtype"], kv.get("layers"))
                    * num_blocks)
            slots = min(max_num_seqs + 1, max(2, budget // per_slot))
            if slots < max_num_seqs + 1:
                import logging

                logging.getLogger("llmc").warning(
                    "%s: max_num_seqs %d -> %d: each sequence's recurrent state takes %.1f MB, and the state pool is "
                    "held to the KV pool's size (raise kv_cache_tokens to run more sequences at once)", root,
                    max_num_seqs, slots - 1, per_slot / 1e6)
                config.max_num_seqs = slots - 1
            state = StatePool.allocate(hybrid, slots)
        return cls(root, manifest, session, pool, blocks, tokenizer, _eos_ids(root), config, state, no_prefix)

    @classmethod
    def _load_cuda(cls, root: Path, manifest: dict, kv_cache_tokens: int | None, config_args: dict, device: str,
                   gpu_memory_utilization: float, cuda_graphs: bool) -> Engine:
        problem = artifact.cuda_problem(manifest, device)
        hybrid = manifest.get("state_cache")
        if not problem and hybrid and int(manifest.get("parallel", {}).get("tensor", 1)) > 1:
            problem = "a tensor-parallel engine with recurrent layers (state_cache); rebuild it without --tp"
        if problem:
            raise UnsupportedError(f"{root / artifact.MANIFEST}: {problem}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise LlmcError(f"gpu_memory_utilization {gpu_memory_utilization}: must be in (0, 1]")
        from llmc.runtime.cuda.session import CudaSession

        kv = manifest["kv_cache"]
        max_len = _max_model_len(root, manifest)
        if int(manifest.get("parallel", {}).get("tensor", 1)) > 1:  # N ranks: this process is rank 0
            from llmc.runtime.cuda.tensor_parallel import TensorParallelSession

            session = TensorParallelSession(root, manifest, device=device, cuda_graphs=cuda_graphs,
                                            max_model_len=max_len)
        else:
            session = CudaSession(root, manifest, device=device, cuda_graphs=cuda_graphs, max_model_len=max_len)
        block_size = int(kv["block_size"])
        # Hybrid models: one state slot per running sequence and one for score(), in device memory beside the KV
        # pool (a slot's size does not depend on the sequence's length, so it is reserved whole, before the blocks).
        state_slots = config_args["max_num_seqs"] + 1 if hybrid else 0
        state_bytes = StatePool.bytes_per_slot(hybrid) * state_slots if hybrid else 0
        no_prefix = ""
        if hybrid and config_args["enable_prefix_caching"]:
            no_prefix = NO_PREFIX_CACHING
            config_args = {**config_args, "enable_prefix_caching": False}
            import logging

            logging.getLogger("llmc").info("%s: prefix caching is off: %s", root, no_prefix)
        if kv_cache_tokens is not None:
            num_blocks = max(1, -(-kv_cache_tokens // block_size))
        elif session.device.type == "cuda":
            vocab = int(manifest["engine"]["vocab_size"])
            # room for a step's activations and float32 logits besides the pool and the weights
            reserve = (1 << 30) + config_args["max_num_tokens"] * vocab * 8 + state_bytes
            num_blocks = session.blocks_that_fit(kv, gpu_memory_utilization, reserve)
            if num_blocks < 1:
                raise LlmcError(f"{root}: no GPU memory left for the KV cache at gpu_memory_utilization "
                                f"{gpu_memory_utilization}; raise it or free the GPU")
        else:
            num_blocks = -(-16384 // block_size)
        pool = session.allocate_pool(kv, num_blocks)
        state = None
        if hybrid:  # the arrays live on the session's device; the engine's StatePool hands out their slots
            arrays = session.allocate_state(hybrid, state_slots)
            state = StatePool(arrays, list(hybrid["arrays"]), list(range(state_slots - 1, -1, -1)))
        tokenizer = Tokenizer(root) if (root / "tokenizer.json").is_file() else None
        blocks = BlockManager(num_blocks, block_size, config_args["enable_prefix_caching"])
        return cls(root, manifest, session, pool, blocks, tokenizer, _eos_ids(root), SchedulerConfig(**config_args),
                   state, no_prefix)

    # -- requests ---------------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> str:
        """Queue one request (text or token ids); returns its id. It runs as :meth:`step` is called.

        Its tokens come back in the outputs of :meth:`step`; :meth:`result` returns its output so far,
        and, once it finished, returns it one last time. Raises ``LlmcError`` for a bad prompt, a
        request that could never fit in the KV pool (the message says how many blocks it needs), or
        a full waiting queue.
        """
        with self._lock:
            rid = self._submit(prompt, params, request_id, "prompt").request_id
            self._retain.add(rid)
            return rid

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                label: str) -> Request:
        params = params or SamplingParams()
        lora_key = self._lora_key(params, label)
        ids = self._tokenize(prompt, label)
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
                arrival_time=time.perf_counter(), rng=np.random.default_rng(seed),
                logprobs=[] if params.logprobs is not None else None,
                text="" if params.stop else None, lora_key=lora_key,
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
            self._finish(req, "cancelled", time.perf_counter())
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
            if not self.scheduler.has_work():
                return outputs
            t0 = time.perf_counter()
            if self.speculator is not None:  # drafts for decoding requests, consumed by schedule()
                self.speculator.propose(self.scheduler.running, len(self.scheduler.waiting))
                if self._structured is not None:  # a constrained request's drafts end where its grammar says
                    for r in self.scheduler.running:
                        if r.draft:
                            r.draft, r.draft_probs = self._structured.filter_draft(r, r.draft, r.draft_probs)
            sched = self.scheduler.schedule()
            self.last_schedule = sched
            if not sched.chunks:
                if not self.scheduler.running:  # nothing runs and nothing could start: would spin forever
                    waiting = len(self.scheduler.waiting)
                    raise RuntimeError(f"scheduler made no progress with {waiting} waiting requests and none "
                                       "running (a bug: please report it)")
                return outputs
            self._pool.copy_blocks(sched.copies)
            chunks = sched.chunks
            state_slots = None
            if self._state is not None:  # preempted sequences start over (from a zero state) when readmitted
                for r in sched.preempted:
                    self._state.release(r.seq_id)
                state_slots = np.asarray([self._state.slot_of(c.request.seq_id) for c in chunks], np.int64)
            ids, pos, slots, tables, ctx, qsl = self._blocks.prepare_step(
                [c.request.seq_id for c in chunks], [c.num_tokens for c in chunks])
            sampling = [c for c in chunks if c.samples]
            # One logits row per sampling chunk; a verify chunk (drafts) needs all of its 1 + k rows.
            rows = np.concatenate([np.arange(qsl[i + 1] - 1 - len(c.draft), qsl[i + 1], dtype=np.int64)
                                   for i, c in enumerate(chunks) if c.samples] or [np.zeros(0, np.int64)])
            # Constrained requests' token masks (one per verified position), computed while the forward pass runs.
            masks = (self._structured.start_masks([(c.request, c.draft) for c in sampling])
                     if self._structured else None)
            feeds = {"input_ids": ids, "positions": pos, "slot_mapping": slots, "block_tables": tables,
                     "context_lens": ctx, "query_start_loc": qsl, "logits_indices": rows}
            if self.lora is not None:
                self.lora.bind(feeds, [c.request.lora_slot for c in chunks], [c.num_tokens for c in chunks],
                               self._lora_feed)
            if self._rope_lengths:
                feeds["rope_lengths"] = np.repeat(np.asarray([len(c.request.tokens) for c in chunks], np.int64),
                                                  [c.num_tokens for c in chunks])
            if state_slots is not None:
                feeds["state_slots"] = state_slots
            # Whole decode/verify steps (proposals and verification included; prefill chunks cost another
            # amount per token) feed the cost model that sizes the drafts. Decided now: sampling changes tokens.
            # (Every chunk has num_tokens >= 1 + len(draft), with equality only for decodes, which all sample; a
            # step is decode-only exactly when it has one logits row per token.)
            pure = self.speculator is not None and len(ids) == len(rows)
            if self._session.samples_on_device:
                picked, host = self._sample_on_device(sampling, feeds)
            else:
                picked, host = {}, self._session.run(feeds, self._pool, state=self._state_arrays())
            self.scheduler.complete(sched)
            now = time.perf_counter()
            at = 0  # host rows: every sampling chunk's but those sampled on the device, in order
            for i, chunk in enumerate(sampling):
                if i in picked:
                    outputs.append(self._emit(chunk.request, *picked[i], now))
                    continue
                n = 1 + len(chunk.draft)
                if chunk.draft:
                    outputs.append(self._accept_draft(chunk, host[at: at + n], now, masks))
                else:
                    outputs.append(self._accept(chunk.request, host[at], now, masks))
                at += n
            if pure:
                self.speculator.observe_step(len(ids), len(chunks), time.perf_counter() - t0)
            self._busy += time.perf_counter() - t0
            return outputs

    def _sample_on_device(self, sampling: list, feeds: dict[str, np.ndarray]
                          ) -> tuple[dict[int, tuple[int, dict[int, float] | None]], np.ndarray | None]:
        """Run the step on a session that samples where its logits are (the CUDA engine's).

        Plain rows (no drafts, no constraint) are sampled there in one batch, and only their token ids
        (and the logprobs asked for) come back: ``{chunk index: (token, logprobs)}``. The other chunks'
        rows (verify chunks, constrained rows) come back as host logits, in order, for the numpy path.
        Each sampled row's uniform comes from its request's own generator, as the numpy sampler draws it,
        so a seed gives the same tokens on either path.
        """
        logits = self._session.run_device(feeds, self._pool)
        starts = np.cumsum([0] + [1 + len(c.draft) for c in sampling])
        plain = [i for i, c in enumerate(sampling) if not c.draft and c.request.params.structured is None]
        rows = []
        for i in plain:
            r = sampling[i].request
            p = r.params
            rows.append(SampleRow(int(starts[i]), p, r.tokens if p.uses_history else (), r.prompt_len,
                                  None if p.greedy else float(r.rng.random())))
        tokens, lps = self._session.sample(logits, rows)
        picked = {i: (t, lp) for i, t, lp in zip(plain, tokens, lps, strict=True)}
        host_idx = [int(j) for i in range(len(sampling)) if i not in picked for j in range(starts[i], starts[i + 1])]
        return picked, self._session.host_rows(logits, host_idx) if host_idx else None

    def _accept_draft(self, chunk, logits: np.ndarray, now: float, masks=None) -> RequestOutput:
        """A verify chunk's ``[1 + k, vocab]`` logits: emit the kept drafts and one more token, in order.

        A constrained request's rows are masked first (row ``i``: what its grammar allows after the first
        ``i`` drafts); the rows after the first forbidden draft stay as they are, as verification rejects
        that draft at the latest and never reads them.
        """
        r, p = chunk.request, chunk.request.params
        allowed = self._structured.allowed(masks, r) if masks is not None else None
        model_logits = logits
        if allowed is not None:
            if not self._structured.usable(r, allowed):  # never verify unconstrained
                return self._constraint_failed(r, now)
            if p.logprobs is not None:  # logprobs stay the model's own distribution
                logits = logits.copy()
            for i, words in enumerate(allowed):
                self._structured.apply(words, logits[i], in_place=True)
        emitted = self.speculator.verify(chunk, logits)
        kept = len(emitted) - 1
        self.scheduler.accept_draft(chunk, kept)
        self.speculator.record(r, len(chunk.draft), kept)
        new: list[int] = []
        lps: list[dict[int, float]] = []
        reason = None
        for i, token in enumerate(emitted):
            lp = token_logprobs(model_logits[i], token, p.logprobs) if p.logprobs is not None else None
            if i < kept:
                self.scheduler.extend_accepted(r, token)
            else:
                self.scheduler.append_token(r, token)
            new.append(token)
            if lp is not None:
                lps.append(lp)
            structured = self._structured.advance(r, token, self.eos_token_ids) if allowed is not None else None
            reason = self._record(r, token, lp, now, structured)
            if reason is not None:  # a stop among the drafts: the tokens after it were never generated
                self._finish(r, reason, now)
                break
        return RequestOutput(r.request_id, new, lps if p.logprobs is not None else None, reason is not None, reason)

    def _record(self, r: Request, token: int, lp: dict[int, float] | None, now: float,
                structured: str | None = None) -> str | None:
        """Book one token that is already in ``r.tokens``; returns the finish reason it causes, if any
        (``structured``: what the request's constraint matcher says after this token, if it has one)."""
        p = r.params
        self._generated += 1
        if r.first_token_time is None:
            r.first_token_time = now
        r.token_times.append(now)
        if lp is not None:
            r.logprobs.append(lp)
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if p.stop and self._hit_stop_string(r):
            if self._structured is not None:  # complete or not: judged on the text returned
                self._structured.cut(r, r.text)
            return "stop"
        if structured is not None:  # "stop": the structure is complete; "error": its matcher failed
            return structured
        if len(r.tokens) - r.prompt_len >= p.max_tokens:
            return "length"
        return None

    def _accept(self, r: Request, logits: np.ndarray, now: float, masks=None) -> RequestOutput:
        p = r.params
        allowed = self._structured.allowed(masks, r) if masks is not None else None
        token = None
        if allowed is not None:
            if not self._structured.usable(r, allowed):  # never sample unconstrained
                return self._constraint_failed(r, now)
            if p.greedy and not p.uses_history:
                # The model's own first argmax, when the grammar allows it, is the masked argmax too (every
                # allowed token before it scores strictly less): no pass over the row.
                top = int(logits.argmax())
                token = top if self._structured.allows(allowed[0], top) else None
            if token is None:
                # In place unless logprobs, which stay the model's own distribution, still need the row.
                masked = self._structured.apply(allowed[0], logits, in_place=p.logprobs is None)
                token = sample(masked, p, r.rng, r.tokens if p.uses_history else (), r.prompt_len)
        else:
            token = sample(logits, p, r.rng, r.tokens if p.uses_history else (), r.prompt_len)
        lp = token_logprobs(logits, token, p.logprobs) if p.logprobs is not None else None
        return self._emit(r, token, lp, now, allowed)

    def _emit(self, r: Request, token: int, lp: dict[int, float] | None, now: float,
              allowed: np.ndarray | None = None) -> RequestOutput:
        """Append the token chosen for ``r`` (``allowed``: its constraint's mask rows, if it has one)."""
        self.scheduler.append_token(r, token)
        structured = self._structured.advance(r, token, self.eos_token_ids) if allowed is not None else None
        reason = self._record(r, token, lp, now, structured)
        if reason is not None:
            self._finish(r, reason, now)
        return RequestOutput(r.request_id, [token], [lp] if lp is not None else None, reason is not None, reason)

    def _constraint_failed(self, r: Request, now: float) -> RequestOutput:
        """End ``r`` with ``"error"``: its constraint's mask is missing or empty (never sample unconstrained)."""
        self._finish(r, "error", now)
        return RequestOutput(r.request_id, [], [] if r.params.logprobs is not None else None, True, "error")

    def _state_arrays(self) -> list[np.ndarray] | None:
        return self._state.arrays if self._state is not None else None

    def _finish(self, r: Request, reason: str, now: float) -> None:
        self.scheduler.finish(r, reason)
        if self._state is not None:
            self._state.release(r.seq_id)
        if self.speculator is not None:
            self.speculator.release(r)
        if self._structured is not None:
            self._structured.finish(r, reason)
        r.finish_time = now
        if r.request_id in self._retain:
            self._retain.discard(r.request_id)
            self._done[r.request_id] = r

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.output_token_ids)
        # Only the tail can hold a stop string that this token completed.
        start = max(0, len(r.text or "") - max(len(s) for s in r.params.stop))
        r.text = text
        hits = [i for i in (text.find(s, start) for s in r.params.stop) if i >= 0]
        if hits:
            r.text = text[: min(hits)]
            return True
        return False

    # -- batch ------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids), batched continuously; outputs in order."""
        reqs = self._submit_all(prompts, params)
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:
            for r in reqs:
                if not r.finished:
                    self.cancel(r.request_id)
        return [self._output(r) for r in reqs]

    def _submit_all(self, prompts, params) -> list[Request]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int | np.integer)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise LlmcError(f"generate: {len(prompts)} prompts but {len(plist)} SamplingParams; pass one or one each")
        reqs: list[Request] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                reqs.append(self._submit(p, sp, None, f"prompt {i}"))
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
        incomplete, error = self._structured.outcome(r) if self._structured is not None else (False, None)
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
            r = self.scheduler.requests.get(request_id) or self._done.pop(request_id, None)
            return self._output(r) if r is not None else None

    # -- streaming --------------------------------------------------------------------------------

    def stream(self, prompts: Prompt | list[Prompt],
               params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield a :class:`StreamEvent` per generated token of every prompt, as steps produce them.

        Other submitted requests keep running in the same steps. Closing the iterator early cancels
        the requests it still has in flight.
        """
        reqs = self._submit_all(prompts, params)
        index = {r.request_id: i for i, r in enumerate(reqs)}
        texts = _TextDeltas(self.tokenizer, reqs)
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
        texts = _TextDeltas(self.tokenizer, reqs)
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
            if self._structured is None:
                self._structured = StructuredRuntime.for_engine(self.path, self.vocab_size, self.eos_token_ids,
                                                                self._structured_config)
            return self._structured

    def stats(self) -> EngineStats:
        """Running/waiting requests, KV blocks, prefix-cache hit rate, preemptions and throughput."""
        with self._lock:
            b, c = self._blocks, self.scheduler.counters
            return EngineStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                kv_blocks_total=b.num_blocks, kv_blocks_used=b.num_used_blocks, kv_blocks_free=b.num_free_blocks,
                kv_blocks_cached=b.num_cached_blocks,
                prefix_cache_hit_rate=b.prefix_hits / b.prefix_queries if b.prefix_queries else 0.0,
                cached_prompt_tokens=c.cached_prompt_tokens, prompt_tokens_computed=c.prompt_tokens_computed,
                recomputed_tokens=c.recomputed_tokens, generated_tokens=self._generated,
                num_preemptions=c.num_preemptions, num_steps=c.num_steps, busy_seconds=self._busy,
                tokens_per_s=self._generated / self._busy if self._busy > 0 else 0.0,
                spec_num_draft_tokens=c.spec_draft_tokens, spec_num_accepted_tokens=c.spec_accepted_tokens,
                spec_num_verify_steps=c.spec_verify_steps,
                spec_acceptance_rate=c.spec_accepted_tokens / c.spec_draft_tokens if c.spec_draft_tokens else 0.0,
                spec_mean_accepted_length=(c.spec_accepted_tokens / c.spec_verify_steps
                                           if c.spec_verify_steps else 0.0),
                spec_draft_seconds=self.speculator.draft_seconds if self.speculator is not None else 0.0,
                **self._lora_stats(),
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
            self._require_lora(f"add_lora({name!r})").add(name, path)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name``; ``LlmcError`` if it is unknown or requests for it are in the engine."""
        with self._lock:
            lora = self._require_lora(f"remove_lora({name!r})")
            users = [r.request_id for r in self.scheduler.requests.values() if r.params.lora == name]
            if users:
                raise LlmcError(f"remove_lora({name!r}): {len(users)} requests for it are in the engine "
                                f"({users[0]}, ...); remove it when they finish or cancel them")
            lora.remove(name)

    def lora_adapters(self) -> dict[str, Path]:
        """The registered adapters: name -> the directory it was read from (empty without LoRA slots)."""
        with self._lock:
            return {n: a.path for n, a in self.lora.adapters.items()} if self.lora is not None else {}

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        sched = self.scheduler
        return dict(running_lora_adapters=tuple(sorted({r.params.lora for r in sched.running if r.params.lora})),
                    waiting_lora_adapters=tuple(sorted({r.params.lora for r in sched.waiting if r.params.lora})),
                    max_lora=self.lora.spec.slots)

    def _require_lora(self, what: str) -> LoraSlots:
        if self.lora is None:
            raise UnsupportedError(f"{what}: engine {self.path} was built without LoRA slots; rebuild it with "
                                   "llmc build --lora-slots S --max-lora-rank R")
        return self.lora

    def _lora_key(self, params: SamplingParams, label: str) -> int:
        if params.lora is None:
            return 0
        lora = self._require_lora(f"{label}: SamplingParams.lora={params.lora!r}")
        adapter = lora.adapters.get(params.lora)
        if adapter is None:
            raise LlmcError(f"{label}: LoRA adapter {params.lora!r} is not loaded (loaded: "
                            f"{', '.join(lora.adapters) or 'none'}); add it with Engine.add_lora first")
        return adapter.key

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
                    self.lora.bind(feeds, [0], [n], self._lora_feed)
                if self._state is not None:  # a slot of its own; the whole sequence is this step's: a fresh state
                    feeds["state_slots"] = np.asarray([self._state.slot_of(_SCORE_SEQ)], np.int64)
                return self._session.run(feeds, self._pool, state=self._state_arrays())
            finally:
                self._blocks.free(blocks)
                if self._state is not None:
                    self._state.release(_SCORE_SEQ)


class _TextDeltas:
    """Turns per-token outputs into stream events with the text each token adds."""

    def __init__(self, tokenizer: Tokenizer | None, reqs: list[Request]) -> None:
        self._tok = tokenizer
        self._reqs = reqs
        self._ids: list[list[int]] = [[] for _ in reqs]  # tokens delivered so far (the request may be ahead)
        self._shown = [""] * len(reqs)

    def events(self, i: int, o: RequestOutput) -> Iterator[StreamEvent]:
        """One event per new token (a speculative step can bring several); the last one carries ``finished``."""
        if not o.new_token_ids:
            yield StreamEvent(i, o.request_id, None, None, None, o.finished, o.finish_reason)
            return
        n = len(o.new_token_ids)
        for j, token in enumerate(o.new_token_ids):
            last = j == n - 1
            lps = [o.new_logprobs[j]] if o.new_logprobs else None
            yield from self._event(i, RequestOutput(o.request_id, [token], lps, o.finished and last,
                                                    o.finish_reason if last else None))

    def _event(self, i: int, o: RequestOutput) -> Iterator[StreamEvent]:
        self._ids[i] += o.new_token_ids
        text = None
        if self._tok is not None:
            r = self._reqs[i]
            if o.finished and o.finish_reason == "stop" and r.params.stop and r.text is not None:
                full = r.text  # cut before the stop string
            else:
                full = self._tok.decode(self._ids[i])
            # A token can end inside a multi-byte character; hold the text back until it completes.
            text = ""
            if not full.endswith("\ufffd") or o.finished:
                if full.startswith(self._shown[i]):
                    text = full[len(self._shown[i]) :]
                self._shown[i] = full
        lp = o.new_logprobs[0] if o.new_logprobs else None
        yield StreamEvent(i, o.request_id, o.new_token_ids[0], text, lp, o.finished, o.finish_reason)


# The state slot owner of score()'s sequence (request seq_ids count up from 0).
_SCORE_SEQ = -1
# A hybrid engine's state pool may take at least this much memory, whatever the KV pool's size.
STATE_MIN_BYTES = 256 << 20


def _max_model_len(root: Path, manifest: dict) -> int | None:
    """The longest sequence (prompt + output tokens) the model supports: its max_position_embeddings."""
    n = manifest.get("engine", {}).get("max_position_embeddings")
    if not n and (root / "hf_config.json").is_file():
        n = json.loads((root / "hf_config.json").read_text()).get("max_position_embeddings")
    return int(n) if n else None


def _eos_ids(root: Path) -> list[int]:
    for name in ("generation_config.json", "hf_config.json"):
        f = root / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
