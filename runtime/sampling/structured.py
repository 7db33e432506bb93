"""Structured outputs: constrain generation to a JSON Schema, any JSON, a regex, a choice or a grammar.

The grammar engine is llguidance (a Rust core; no torch). This module only glues it to the runtime:

- :class:`StructuredOutputs` is the user's constraint (one kind per request), set as
  ``SamplingParams(structured=...)``.
- :class:`GrammarCompiler` turns it into an llguidance grammar over the engine's own tokenizer
  (``tokenizer.json``), refuses one that does not compile or exceeds the limits (``LlmcError``
  naming the failing part, before any token is generated), and caches compiled grammars by content.
- :class:`StructuredRuntime` holds each constrained request's matcher, computes the token masks of a
  step's constrained requests (in a worker while the forward pass runs; after it, the step thread
  finishes the fast ones), one per verified position under speculative decoding (drafts cut where the
  grammar forbids them; the matcher consumes the drafts to mask the positions after them, then rolls them
  back), and tells the engine how a request ends.

Masks are bitmasks ``int32 [batch, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32`` set: token
``t`` allowed). A matcher's state is the output tokens it consumed; it lives with the request, so a
preempted request that is recomputed keeps it (a recompute samples nothing until it reaches the end).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import LlmcError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_NEG_INF = np.float32(-np.inf)
# _BYTE_BIAS[b, i]: 0 if bit i of byte b is set (token allowed), else -inf (little-endian bit order, as
# llguidance's bitmask: bit t % 32 of int32 word t // 32, i.e. bit t % 8 of byte t // 8).
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
                      np.float32(0.0), _NEG_INF).astype(np.float32)


@dataclass
class StructuredOutputs:
    """One constraint on a request's output; set exactly one field.

    - ``json``: a JSON Schema (a dict, or its JSON text); the output is one JSON value valid under it.
    - ``json_object``: ``True``: the output is any JSON object (OpenAI's ``{"type": "json_object"}``).
    - ``regex``: the whole output matches this regular expression (Rust ``regex`` syntax; anchored).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar in Lark syntax (llguidance's variant) or GBNF (llama.cpp's).

    ``whitespace_flexible`` (JSON kinds only): allow any whitespace between JSON tokens (default: the
    compact form, ``{"a":1}``, which is what small models follow best and what costs fewest tokens).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise LlmcError(f"StructuredOutputs: set exactly one of {', '.join(KINDS)} (got {what})")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise LlmcError(f"StructuredOutputs.json: must be a JSON Schema object or its JSON text "
                            f"(got {type(self.json).__name__})")
        if self.json_object not in (True, False):
            raise LlmcError("StructuredOutputs.json_object: must be true or false")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise LlmcError("StructuredOutputs.regex: must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise LlmcError("StructuredOutputs.choice: must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise LlmcError("StructuredOutputs.grammar: must be a non-empty Lark or GBNF grammar")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def coerce(cls, value: StructuredOutputs | dict) -> StructuredOutputs:
        """``value`` itself, or a :class:`StructuredOutputs` made from a dict of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {*KINDS, "whitespace_flexible"})
            if unknown:
                raise LlmcError(f"structured: unknown field {unknown[0]!r}; use one of {', '.join(KINDS)}")
            return cls(**value)
        raise LlmcError("SamplingParams.structured: must be a StructuredOutputs or a dict "
                        f"(got {type(value).__name__})")

    def key(self) -> str:
        """Content key for the compiled-grammar cache (equal constraints share one compiled grammar)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:  # {"a": 1} and {"a":1} are the same schema
                value = json.loads(value)
            except ValueError:
                pass
        text = json.dumps([self.kind, value, self.whitespace_flexible], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class StructuredConfig:
    """Bounds on what a constraint may cost. Exceeding one refuses the request (or ends it; see below).

    ``max_spec_bytes`` caps the constraint's text (schema JSON, regex, grammar). ``compile_timeout_s``
    bounds compiling one constraint; it runs off the step loop, and a slower one is refused.
    The llguidance limits bound the work per mask (``step_lexer_fuel`` ~14k/ms, ``step_max_items``
    ~20k/ms of one core) and the grammar's size (``max_grammar_size`` symbols, ``max_lexer_states``,
    ``initial_lexer_fuel`` ~50k/ms for building the lexer): a step whose mask would exceed them puts the
    request's matcher in an error state and the request ends with ``finish_reason == "error"``; it never
    goes on unconstrained. ``cache_size`` compiled grammars are kept (least recently used evicted).
    ``overlap``: compute a step's masks in worker threads while the forward pass runs.
    ``mask_threads``: those workers (None: half the cores). ``mask_timeout_s``: how long a step waits,
    after its forward pass, for a request's mask; a later one ends that request (``"error"``), so a
    hostile grammar delays the requests batched with it by at most this much (the overlap-free path,
    ``overlap=False``, has no deadline: only the llguidance limits bound it).
    """

    max_spec_bytes: int = 256 * 1024
    compile_timeout_s: float = 5.0
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    initial_lexer_fuel: int = 1_000_000
    max_grammar_size: int = 200_000
    max_lexer_states: int = 100_000
    max_items_in_row: int = 2000
    cache_size: int = 256
    overlap: bool = True
    mask_threads: int | None = None
    mask_timeout_s: float = 0.2

    def limits(self):
        import llguidance

        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False)


def _import_llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask helpers)
    except ImportError as exc:
        raise LlmcError("structured outputs need the llguidance package: pip install llguidance") from exc
    return llguidance


def _first_line(message: str) -> str:
    """llguidance's multi-line message on one line: caret markers dropped, at most 300 characters."""
    lines = [ln.strip() for ln in str(message).strip().splitlines() if ln.strip().strip("^ ")]
    return " / ".join(lines)[:300] if lines else "unknown error"


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` over one tokenizer; thread-safe; caches by content.

    ``tokenizer_json``: the engine's ``tokenizer.json`` text; ``vocab_size``: the model's logits width
    (can exceed the tokenizer's: padded rows are never allowed); ``eos_ids``: the tokens that end a
    sequence, allowed only where the grammar can end.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int],
                 config: StructuredConfig | None = None) -> None:
        llg = _import_llguidance()
        if not eos_ids:
            raise LlmcError("structured outputs need the model's EOS token id (generation_config.json or "
                            "config.json eos_token_id) to end a completed structure")
        self.config = config or StructuredConfig()
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        self._limits = self.config.limits()
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> template LLMatcher (initial state)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="llmc-grammar")
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_engine_dir(cls, path: Path, vocab_size: int, eos_ids: Sequence[int],
                       config: StructuredConfig | None = None) -> GrammarCompiler:
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise LlmcError(f"{tj}: missing; structured outputs need the engine's tokenizer")
        return cls(tj.read_text(encoding="utf-8"), vocab_size, eos_ids, config)

    def grammar_text(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar (JSON text) for ``spec``; ``LlmcError`` if it cannot even be parsed."""
        llg = _import_llguidance()
        kind = spec.kind
        value = getattr(spec, kind)
        if kind in ("json", "json_object"):
            schema: Any = {"type": "object"} if kind == "json_object" else value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise LlmcError(f"structured.json: not valid JSON ({exc}); give a JSON Schema object") from exc
            if not isinstance(schema, dict | bool):
                raise LlmcError(f"structured.json: a JSON Schema must be an object (got {type(schema).__name__})")
            size = len(json.dumps(schema))
            self._check_size("json", size)
            opts = {"whitespace_flexible": spec.whitespace_flexible, "lenient": False}
            try:
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)
            except (ValueError, TypeError) as exc:
                raise LlmcError(f"structured.json: {_first_line(exc)}") from exc
        if kind == "regex":
            self._check_size("regex", len(value.encode()))
            return llg.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            self._check_size("choice", sum(len(c.encode()) for c in value))
            # Each choice is a string literal of the Lark grammar (json.dumps escapes it).
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        self._check_size("grammar", len(value.encode()))
        try:
            return llg.grammar_from("grammar", value)  # Lark as is; GBNF converted to Lark
        except ValueError as exc:
            raise LlmcError(f"structured.grammar: {_first_line(exc)}") from exc

    def _check_size(self, kind: str, size: int) -> None:
        if size > self.config.max_spec_bytes:
            raise LlmcError(f"structured.{kind}: {size} bytes exceed the limit of {self.config.max_spec_bytes} "
                            "(StructuredConfig.max_spec_bytes); simplify the constraint")

    def compile(self, spec: StructuredOutputs | dict) -> Any:
        """A fresh matcher (llguidance ``LLMatcher``) at the start of ``spec``'s language.

        Raises ``LlmcError`` naming the failing part when the constraint is invalid, exceeds a limit,
        or takes longer than ``compile_timeout_s`` to compile. Cached: the same constraint compiles once.
        """
        spec = StructuredOutputs.coerce(spec)
        key = spec.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return template.deep_copy()
        fut = self._pool.submit(self._build, spec)
        try:
            template = fut.result(timeout=self.config.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            # The build goes on in its thread (bounded by the lexer fuel) and is dropped; the request is refused.
            raise LlmcError(f"structured.{spec.kind}: compiling took longer than {self.config.compile_timeout_s} s "
                            "(StructuredConfig.compile_timeout_s); simplify the constraint") from None
        with self._lock:
            self.misses += 1
            self._cache[key] = template
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _build(self, spec: StructuredOutputs):
        llg = _import_llguidance()
        grammar = self.grammar_text(spec)
        # The matcher never raises for a bad grammar: it enters an error state that says why.
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise LlmcError(f"structured.{spec.kind}: {_first_line(matcher.get_error())}")
        return matcher


@dataclass
class _State:
    """One constrained request: its matcher, how its structure ended, and its latest mask's cost."""

    matcher: Any
    incomplete: bool = False
    error: str | None = None
    done: bool = False
    last_mask_s: float | None = None  # None: no mask computed yet


class PendingMasks:
    """Masks being computed for one step. Each constrained request is an *entry* with ``1 + k`` rows of
    ``bitmask`` (``k``: its draft tokens the grammar allows, under speculative decoding): the mask for its
    next token, then the mask after each of those drafts.

    Entries are claimed under ``cond``: mask workers take them from the front, the step thread (once its
    forward pass is done) from the back, but only entries whose request's previous mask was fast, so a
    slow grammar's masks are always a worker's and the step thread waits for them no longer than the
    deadline.
    """

    def __init__(self, bitmask: np.ndarray, index: dict[int, int], states: list[_State], drafts: list[Sequence[int]],
                 starts: list[int], stealable: int, threaded: bool) -> None:
        self.bitmask = bitmask  # int32 [rows of all entries, ceil(vocab / 32)]
        self.index = index  # id(request) -> entry
        self.states = states  # entry -> the request's state
        self.drafts = drafts  # entry -> its draft tokens (empty: none)
        self.starts = starts  # entry -> its first row
        self.valid = [0] * len(states)  # entry -> how many of its drafts the grammar allows (rows after the first)
        self.done = [not threaded] * len(states)
        self.front = 0  # next entry a worker claims
        self.back = len(states) - 1  # next entry the step thread may claim
        self.first_stealable = len(states) - stealable  # entries from here on may be claimed by the step thread
        self.cond = threading.Condition() if threaded else None
        self.helped = not threaded  # whether the step thread has claimed its entries yet
        self.deadline: float | None = None  # set when the caller first waits (after its forward pass)


class StructuredRuntime:
    """The engine's side of structured outputs: matchers per request, masks per step, how requests end."""

    # The step thread computes a waiting request's masks itself (rather than wait for a worker to be
    # scheduled) only if that request's previous mask took less than this: a grammar whose masks are slow
    # stays with the workers, under the mask_timeout_s deadline.
    STEAL_BELOW_S = 0.001

    def __init__(self, compiler: GrammarCompiler) -> None:
        _import_llguidance()
        self.compiler = compiler
        self.config = compiler.config
        self.vocab_size = compiler.vocab_size
        self._words = (self.vocab_size + 31) // 32
        self._threads = self.config.mask_threads or max(1, (os.cpu_count() or 2) // 2)
        # A step's entries go to at most _threads tasks that claim them one by one (not one task per
        # request: a handoff costs ~30 us on a loaded machine, more than a mask); each keeps its own deadline.
        self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="llmc-mask")
        # Keyed by the request object (weakly): the state goes when the request does, and the
        # scheduler's Request needs no field of its own.
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.mask_seconds = 0.0  # summed time of mask computations (in workers when overlapped)
        self.masks = 0

    def attach(self, request, matcher) -> None:
        """Give ``request`` its matcher (from ``self.compiler.compile(spec)``, made before submitting)."""
        self._states[request] = _State(matcher)

    def has(self, request) -> bool:
        return request in self._states

    def filter_draft(self, request, draft: list[int], probs: np.ndarray | None) -> tuple[list[int], np.ndarray | None]:
        """``request``'s speculative drafts cut where its grammar forbids one (unconstrained: unchanged).

        Point-mass drafts (prompt lookup, greedy drafting) end before the first forbidden token. Sampled
        drafts keep it: its target probability is 0 under the mask, so verification rejects it and draws
        the replacement from ``max(p - q, 0)``, which keeps the output distributed exactly as the target's
        (dropping it would skew that position toward ``p``).
        """
        s = self._states.get(request)
        if s is None or s.done or not draft:
            return draft, probs
        n = s.matcher.validate_tokens(draft)
        if n >= len(draft):
            return draft, probs
        if probs is None:
            return draft[:n], None
        return draft[: n + 1], probs[: n + 1]

    def start_masks(self, entries: Sequence[tuple[Any, Sequence[int]]]) -> PendingMasks | None:
        """Begin computing the masks of the constrained ones among ``entries`` (request, its draft tokens).

        A request gets the mask for its next token and, per draft token the grammar allows, the mask
        after it (its matcher consumes the drafts, then rolls them back). With ``config.overlap`` mask
        workers start on them (llguidance drops the GIL), so the caller runs the forward pass meanwhile;
        :meth:`allowed` then finishes the rest and waits for one request's masks.
        """
        triples = [(r, s, d) for r, d in entries if (s := self._states.get(r)) is not None and not s.done]
        if not triples:
            return None
        threaded = self.config.overlap
        if threaded:  # the entries the step thread may take go last (it claims from the back)
            triples.sort(key=lambda t: self._stealable(t[1]))
        starts, rows = [], 0
        for _, _, d in triples:
            starts.append(rows)
            rows += 1 + len(d)
        states = [s for _, s, _ in triples]
        p = PendingMasks(np.zeros((rows, self._words), np.int32), {id(r): i for i, (r, _, _) in enumerate(triples)},
                         states, [list(d) for _, _, d in triples], starts,
                         sum(map(self._stealable, states)) if threaded else 0, threaded)
        if threaded:
            for _ in range(min(self._threads, len(states))):
                self._pool.submit(self._work, p)
        else:
            for i in range(len(states)):
                dt, n = self._entry(p, i)
                self.mask_seconds += dt
                self.masks += n
        return p

    def _stealable(self, s: _State) -> bool:
        return s.last_mask_s is not None and s.last_mask_s < self.STEAL_BELOW_S

    def _work(self, p: PendingMasks) -> None:
        """A mask worker: claim entries from the front until none is left."""
        while True:
            with p.cond:
                if p.front > p.back:
                    return
                i = p.front
                p.front += 1
            self._compute(p, i)

    def _help(self, p: PendingMasks) -> None:
        """The step thread, after its forward pass: compute the unclaimed entries that are known to be fast."""
        p.helped = True
        while True:
            with p.cond:
                if p.back < p.front or p.back < p.first_stealable:
                    return
                i = p.back
                p.back -= 1
            self._compute(p, i)

    def _compute(self, p: PendingMasks, i: int) -> None:
        dt, n = self._entry(p, i)
        with p.cond:
            p.done[i] = True
            self.mask_seconds += dt
            self.masks += n
            p.cond.notify_all()

    def _entry(self, p: PendingMasks, i: int) -> tuple[float, int]:
        """Fill entry ``i``'s rows; returns (seconds, masks computed)."""
        s, start, draft = p.states[i], p.starts[i], p.drafts[i]
        dt = self._fill(s, p.bitmask[start])
        if not draft:
            return dt, 1
        m = s.matcher
        v = m.validate_tokens(draft)  # the drafts were cut at the first forbidden one (filter_draft)
        for j in range(v):
            if not m.consume_token(draft[j]):  # a limit hit mid-draft: the rows after stay empty (refused)
                v = j
                break
            dt += self._fill(s, p.bitmask[start + 1 + j])
        m.rollback(v)  # the matcher consumes what verification emits, like any other token
        p.valid[i] = v
        return dt, 1 + v

    def _fill(self, s: _State, row: np.ndarray) -> float:
        t0 = time.perf_counter()
        s.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # writes row in place; drops the GIL
        s.last_mask_s = dt = time.perf_counter() - t0
        return dt

    def allowed(self, pending: PendingMasks | None, request) -> np.ndarray | None:
        """The bitmask rows (``int32 [1 + k, ceil(vocab / 32)]``) of the tokens ``request`` may produce next
        and, under speculation, after each of the ``k`` draft tokens its grammar allows; None if it is
        unconstrained. Apply a row with :meth:`apply`.

        Waits for its masks until ``config.mask_timeout_s`` after the first wait of the step (the end of
        the forward pass). A late mask fails the request: an all-zero row, which :meth:`usable` refuses;
        its matcher is left to the worker still computing and never used again.
        """
        if pending is None or (i := pending.index.get(id(request))) is None:
            return None
        if not pending.done[i]:
            if not pending.helped:
                self._help(pending)
            if not pending.done[i]:
                now = time.perf_counter()
                if pending.deadline is None:
                    pending.deadline = now + self.config.mask_timeout_s
                with pending.cond:
                    ok = pending.cond.wait_for(lambda: pending.done[i], max(0.0, pending.deadline - now))
                if not ok:
                    self._fail(self._states[request], f"computing its token mask took longer than "
                               f"{self.config.mask_timeout_s} s (StructuredConfig.mask_timeout_s)")
                    return np.zeros((1, self._words), np.int32)
        start = pending.starts[i]
        return pending.bitmask[start: start + 1 + pending.valid[i]]

    @staticmethod
    def allows(words: np.ndarray, token: int) -> bool:
        """Whether bitmask row ``words`` allows ``token`` (bit ``token % 32`` of word ``token // 32``)."""
        return bool((int(words[token >> 5]) >> (token & 31)) & 1)

    def apply(self, words: np.ndarray, logits: np.ndarray, in_place: bool) -> np.ndarray:
        """``logits`` ``[vocab]`` with every token that bitmask row ``words`` forbids set to -inf; in place
        (no copy of the row) when the caller needs the model's own logits no more."""
        # Each mask byte picks its 8 additive biases (0 or -inf) from a 256-row table, and one add applies
        # them: ~2.5x faster than unpacking the bits and a putmask (3 vs 8 us for 4096 tokens).
        bias = _BYTE_BIAS.take(words.view(np.uint8), axis=0).reshape(-1)[: self.vocab_size]
        if in_place:
            np.add(logits, bias, out=logits)
            return logits
        return logits + bias

    def failed(self, request) -> str | None:
        """Why ``request``'s matcher cannot go on (a limit or an internal error), or None."""
        s = self._states.get(request)
        if s is None:
            return None
        m = s.matcher
        if m.is_error():
            return _first_line(m.get_error())
        return None

    def advance(self, request, token: int, eos_ids: Sequence[int]) -> str | None:
        """Feed the sampled ``token``; returns ``"stop"`` when the structure is complete and nothing may
        follow (the matcher accepts only EOS now, or ``token`` is an EOS it allowed), ``"error"`` when the
        matcher failed, else None."""
        s = self._states.get(request)
        if s is None or s.done:
            return None
        m = s.matcher
        if token in eos_ids:
            # Only reachable where the grammar may end (the mask allows EOS only there).
            s.done = True
            return "stop" if m.is_accepting() else self._fail(s, "EOS outside an accepting state")
        if not m.consume_token(token):
            return self._fail(s, _first_line(m.get_error()))
        if m.is_stopped():
            s.done = True
            return "stop"
        return None

    def _fail(self, s: _State, why: str) -> str:
        s.done, s.error, s.incomplete = True, why, True
        return "error"

    def finish(self, request, reason: str) -> None:
        """Record how ``request`` ended: any end other than a completed structure marks it incomplete."""
        s = self._states.get(request)
        if s is None:
            return
        if not s.done:
            s.done = True
            s.incomplete = not s.matcher.is_accepting()

    def cut(self, request, text: str) -> None:
        """A stop string ended ``request`` and cut its text to ``text``: judge completeness on that text,
        not on the tokens generated (which ran past the cut, and may have completed the structure)."""
        s = self._states.get(request)
        if s is None or s.error is not None:
            return
        m = s.matcher
        m.reset()  # the request is over; its matcher is free to re-read the returned text
        # Greedy tokens of the exact bytes: the matcher works on bytes, so any tokenization of them does.
        ok = m.consume_tokens(self.compiler.tokenizer.greedy_tokenize(text))
        s.done, s.incomplete = True, not (ok and m.is_accepting())

    def outcome(self, request) -> tuple[bool, str | None]:
        """``(structured_incomplete, structured_error)`` of a finished request (``(False, None)``: complete)."""
        s = self._states.get(request)
        if s is None:
            return False, None
        return s.incomplete, s.error

    def usable(self, request, words: np.ndarray) -> bool:
        """Whether ``request`` can go on under its bitmask rows ``words`` (from :meth:`allowed`); if not,
        records why (its matcher failed, or some row allows no token) and the caller ends it with
        ``finish_reason == "error"``."""
        s = self._states[request]
        if s.error is not None:  # failed already (a late mask): its matcher may still be in a worker's hands
            return False
        # (one row, the common case: a flat any(), several times cheaper than a per-row reduction)
        some = words.any() if len(words) == 1 else bool(words.any(axis=1).all())
        why = self.failed(request) or (None if some else "no token is allowed here")
        if why is None:
            return True
        self._fail(s, why)
        return False

    @classmethod
    def for_engine(cls, path: Path, vocab_size: int, eos_ids: Sequence[int],
                   config: StructuredConfig | None = None) -> StructuredRuntime:
        """The runtime for the engine at ``path`` (its ``tokenizer.json``, logits width and EOS ids)."""
        return cls(GrammarCompiler.for_engine_dir(path, vocab_size, eos_ids, config))
