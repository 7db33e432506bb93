"""Structured outputs (runtime/sampling/structured.py): seeded random constraints through real engines.

Every completed output must be in its constraint's language (JSON Schemas checked by ``jsonschema``),
under greedy and sampled decoding, batched beside unconstrained requests, on the trained default model
and a random-weight one. Invalid and over-limit constraints are refused before any token; a slow grammar
is bounded; preemption, prefix caching, stop strings and logprobs keep working.
"""

from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.sampling.structured import StructuredConfig, StructuredOutputs
from llmc.testing.structured_cases import random_cases

PROMPTS = ["A JSON value:", "The for statement", "def f(x):", "Answer:"]


@pytest.fixture(scope="module")
def default(default_engine) -> Engine:
    return Engine.load(default_engine, num_threads=2)


@pytest.fixture(scope="module")
def tiny(tiny_engine) -> Engine:
    return Engine.load(tiny_engine, num_threads=2)


def _run_cases(engine: Engine, n: int, seed: int, temperature: float) -> None:
    """``n`` random cases and every 4th slot an unconstrained request, in one generate() call."""
    cases = random_cases(n, seed=seed)
    prompts, params, which = [], [], []
    for i, (spec, check) in enumerate(cases):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(max_tokens=48, temperature=temperature, seed=seed * 1000 + i, structured=spec))
        which.append((spec, check))
        if i % 4 == 0:
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(SamplingParams(max_tokens=8, temperature=temperature, seed=i))
            which.append(None)
    outs = engine.generate(prompts, params)
    complete = 0
    for case, out in zip(which, outs, strict=True):
        if case is None:
            assert not out.structured_incomplete and out.structured_error is None
            continue
        spec, check = case
        assert out.structured_error is None, (spec, out.structured_error)
        assert out.finish_reason in ("stop", "length")
        if not out.structured_incomplete:  # complete (a "length" one can be: "12+3" may end or go on)
            check(out.text)  # raises if the text is not in the constraint's language
            complete += 1
        else:  # stopped by max_tokens first: said so, not passed off as complete
            assert out.finish_reason == "length", (spec, out)
    # Nearly all finish within 48 tokens (the cases are bounded); a constraint that never ends would fail here.
    assert complete >= 0.8 * n, f"only {complete} of {n} complete"


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_random_constraints_on_the_default_model(default, temperature):
    _run_cases(default, 150, seed=1 if temperature else 0, temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_random_constraints_on_random_weights(tiny, temperature):
    _run_cases(tiny, 100, seed=3 if temperature else 2, temperature=temperature)


def test_the_checkers_reject_unconstrained_output(default):
    """The validation above can fail: the same cases' unconstrained outputs mostly do not pass it."""
    cases = random_cases(40, seed=0)
    outs = default.generate([PROMPTS[i % 4] for i in range(40)],
                            [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(40)])
    failed = 0
    for (_, check), out in zip(cases, outs, strict=True):
        try:
            check(out.text)
        except Exception:  # noqa: BLE001  (any failure: bad JSON, schema violation, no match)
            failed += 1
    assert failed >= 35


def test_unconstrained_neighbours_are_untouched_and_batching_changes_nothing(tiny):
    """Greedy: constrained and unconstrained requests give the same tokens alone and batched together."""
    specs = [spec for spec, _ in random_cases(6, seed=5)]
    plain = SamplingParams(max_tokens=12)
    alone = [tiny.generate(PROMPTS[1], plain)[0].token_ids]
    alone += [tiny.generate(PROMPTS[0], SamplingParams(max_tokens=32, structured=s))[0].token_ids for s in specs]
    batched = tiny.generate([PROMPTS[1]] + [PROMPTS[0]] * len(specs),
                            [plain] + [SamplingParams(max_tokens=32, structured=s) for s in specs])
    assert [o.token_ids for o in batched] == alone


def test_eos_only_where_the_grammar_ends_and_exact_structures(default):
    exact = [({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"regex": r"[0-9]{6}"}, lambda t: len(t) == 6 and t.isdigit()),
             ({"json": {"type": "object", "properties": {"a": {"const": 7}}, "required": ["a"],
                        "additionalProperties": False}}, lambda t: json.loads(t) == {"a": 7})]
    outs = default.generate(["Answer:"] * 3, [SamplingParams(max_tokens=20, structured=s) for s, _ in exact])
    for (spec, ok), out in zip(exact, outs, strict=True):
        assert out.finish_reason == "stop" and not out.structured_incomplete, (spec, out.text)
        assert ok(out.text), (spec, out.text)
        # It stopped because the structure was complete: no EOS sampled (the matcher accepted only EOS).
        assert not set(out.token_ids) & set(default.eos_token_ids)


def test_invalid_constraints_are_refused_before_generation(tiny):
    bad = [({"json": {"type": "strin"}}, "structured.json", "strin"),
           ({"json": '{"type": '}, "structured.json", "not valid JSON"),
           ({"json": {"$ref": "#/definitions/missing"}}, "structured.json", "missing"),
           ({"json": {"type": "string", "pattern": "(a"}}, "structured.json", "unclosed group"),
           ({"regex": "[a-"}, "structured.regex", "unclosed character class"),
           ({"grammar": "start: a\na: \"x\" b"}, "structured.grammar", "unknown name"),
           ({"regex": "a", "choice": ["b"]}, "exactly one of", "regex, choice"),
           ({"choice": []}, "StructuredOutputs.choice", "non-empty"),
           ({"choice": ["", "x"]}, "StructuredOutputs.choice", "non-empty"),
           ({"jsn": {}}, "structured: unknown field 'jsn'", "json")]
    for spec, *words in bad:
        with pytest.raises(LlmcError) as info:
            tiny.generate("x", SamplingParams(max_tokens=4, structured=spec))
        msg = str(info.value)
        assert "\n" not in msg and all(w in msg for w in words), (spec, msg)
    assert not tiny.scheduler.requests  # nothing was queued


def test_over_limit_constraints_are_refused(tiny_engine):
    cfg = StructuredConfig(max_spec_bytes=4096, max_grammar_size=2000, max_lexer_states=10_000)
    engine = Engine.load(tiny_engine, num_threads=1, structured_config=cfg)
    big_enum = {"enum": [f"value-{i}" for i in range(1000)]}
    with pytest.raises(LlmcError, match=r"structured\.json: \d+ bytes exceed the limit of 4096"):
        engine.generate("x", SamplingParams(structured={"json": big_enum}))
    # A grammar whose size exceeds max_grammar_size is refused by llguidance's own limit, named.
    big_alt = "start: " + " | ".join(f'"w{i}"' for i in range(800))
    with pytest.raises(LlmcError, match=r"structured\.grammar: .*(size|limit|too)"):
        engine.generate("x", SamplingParams(structured={"grammar": big_alt}))
    assert not engine.scheduler.requests


def test_structured_config_is_a_load_option(tiny, tiny_engine):
    assert tiny.structured.config == StructuredConfig()  # the defaults without one
    with pytest.raises(LlmcError, match=r"structured_config: must be a StructuredConfig \(got dict\)"):
        Engine.load(tiny_engine, structured_config={"overlap": False})


def test_compile_time_is_bounded(tiny_engine):
    cfg = StructuredConfig(compile_timeout_s=1e-4)  # nothing of size compiles this fast
    engine = Engine.load(tiny_engine, num_threads=1, structured_config=cfg)
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x{i}$"}
                                               for i in range(300)}}
    with pytest.raises(LlmcError, match=r"compiling took longer than 0.0001 s"):
        engine.generate("x", SamplingParams(structured={"json": schema}))


AMBIGUOUS = 'start: e "."\ne: e e | e e e | "a" | "b"'


def test_a_slow_grammar_does_not_delay_its_neighbours_beyond_the_bound(default_engine):
    """A request deep in a highly ambiguous parse (each mask ~0.05-0.3 s) beside an unconstrained one:
    with mask_timeout_s=0.02 the step it is in lasts at most that much longer than a plain step, and it
    ends with finish_reason "error" naming the limit (never unconstrained)."""
    cfg = StructuredConfig(mask_timeout_s=0.02)
    engine = Engine.load(default_engine, num_threads=1, structured_config=cfg)
    rt = engine.structured
    assert rt.config is cfg
    matcher = rt.compiler.compile({"grammar": AMBIGUOUS})
    # Drive the real matcher deep into the ambiguous parse (the model would take as long to get there).
    assert matcher.consume_tokens(rt.compiler.tokenizer.tokenize_str("ab" * 110))
    probe = matcher.deep_copy()
    row = np.zeros((engine.vocab_size + 31) // 32, np.int32)
    t0 = time.perf_counter()
    probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    slow = time.perf_counter() - t0
    assert slow > 0.04, f"the probe's mask took only {slow:.3f} s: the test would prove nothing"

    plain = engine.submit("The for statement", SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(4):  # warm: prefill and a few plain decode steps
        engine.step()
    t0 = time.perf_counter()
    for _ in range(5):
        engine.step()
    base = (time.perf_counter() - t0) / 5
    hostile = engine.submit("x", SamplingParams(max_tokens=40))
    rt.attach(engine.scheduler.requests[hostile], matcher)
    engine.step()  # the hostile request's prefill: its mask is late
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = engine.result(hostile)
    assert out.finish_reason == "error" and out.structured_incomplete
    assert "mask_timeout_s" in out.structured_error
    assert not out.token_ids
    # The step that waited for the late mask; generous slack for a shared 2-core machine.
    assert max(times[:3]) < base + cfg.mask_timeout_s + 0.15, (base, times[:3])
    assert engine.result(plain).finish_reason == "length"


def test_preemption_keeps_matcher_state(tiny_engine):
    """A pool too small for the batch preempts and recomputes; outputs equal those of a roomy pool."""
    # Long forced structures (~40 tokens each), so that ten of them overflow a pool of 160 tokens.
    digits = {"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                       "minItems": 20, "maxItems": 20}}
    specs = [digits if i % 2 else {"regex": "[0-9a-f]{40}"} for i in range(10)]
    params = [SamplingParams(max_tokens=60, temperature=0.7, seed=i, structured=s) for i, s in enumerate(specs)]
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(len(specs))]
    roomy = Engine.load(tiny_engine, num_threads=1).generate(prompts, params)
    tight_engine = Engine.load(tiny_engine, num_threads=1, kv_cache_tokens=160)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.scheduler.counters.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert [o.finish_reason for o in tight] == ["stop"] * 10
    for spec, o in zip(specs, tight, strict=True):
        assert (len(json.loads(o.text)) == 20) if "json" in spec else (len(o.text) == 40), o.text


def test_prefix_cache_n_copies_stop_strings_and_logprobs(default):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = StructuredOutputs(json=schema)
    hits = default.structured.compiler.hits
    # n = 4 samples of one prompt (as the server submits n > 1): shared prefix blocks, one compiled grammar.
    prompt = "Here is a record in JSON, with a name and a number: " * 3
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=spec, logprobs=2) for s in range(4)]
    outs = default.generate([prompt] * 4, params)
    assert default.structured.compiler.hits >= hits + 3
    assert sum(o.num_cached_tokens for o in outs) > 0 or default.stats().cached_prompt_tokens > 0
    for o in outs:
        assert o.finish_reason == "stop" and not o.structured_incomplete
        obj = json.loads(o.text)
        assert set(obj) == {"name", "n"}
        assert len(o.logprobs) == len(o.token_ids)
        for t, lp in zip(o.token_ids, o.logprobs, strict=True):
            assert t in lp and lp[t] <= 0.0 and len(lp) >= 2  # the model's own log-probabilities
    # A stop string cuts the text before the structure completes: finish "stop", flagged incomplete.
    cut = default.generate(prompt, SamplingParams(max_tokens=40, structured=spec, stop=['"n"']))[0]
    assert cut.finish_reason == "stop" and cut.structured_incomplete and '"n"' not in cut.text
    # The tokens complete the structure but the stop string cuts its closing brace: judged on the text
    # returned, which is incomplete (the tokens alone would say complete).
    brace = default.generate(prompt, SamplingParams(max_tokens=40, structured=spec, stop=["}"]))[0]
    assert brace.finish_reason == "stop" and brace.structured_incomplete, brace
    assert default.tokenizer.decode(brace.token_ids).endswith("}") and not brace.text.endswith("}")


RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
# Prompts that hold compact JSON records, so prompt lookup finds drafts in constrained outputs too.
SPEC_PROMPTS = ['{"name":"ab","n":12}\n{"name":"cd","n":34}\n', "A record:", '{"name":"x","n":5} {"name":"',
                "def f(x): return x + 1\ndef f(x):"]


def _spec_cases(temperature: float) -> tuple[list[str], list[SamplingParams], list]:
    """A batch of constrained requests (the record schema and random cases) and an unconstrained neighbour."""
    cases = [({"json": RECORD}, None)] * 2 + random_cases(6, seed=21)
    prompts, params = [], []
    for i, (spec, _) in enumerate(cases):
        prompts.append(SPEC_PROMPTS[i % len(SPEC_PROMPTS)])
        params.append(SamplingParams(max_tokens=40, temperature=temperature, seed=100 + i, structured=spec,
                                     logprobs=2 if i == 1 else None))
    prompts.append("The for statement is used to iterate over the elements of a sequence. The for statement")
    params.append(SamplingParams(max_tokens=40, temperature=temperature, seed=7, ignore_eos=True))
    return prompts, params, [c for _, c in cases]


def _check_outputs(outs, checks) -> int:
    """Every complete constrained output is in its language; returns how many are complete."""
    complete = 0
    for out, check in zip(outs, checks, strict=False):
        assert out.structured_error is None, out.structured_error
        if not out.structured_incomplete:
            if check is None:  # the record schema
                jsonschema.validate(json.loads(out.text), RECORD)
            else:
                check(out.text)
            complete += 1
    return complete


@pytest.fixture(scope="module", params=["ngram", "draft"])
def speculating(request, default_engine) -> Engine:
    """The default model speculating on every step (never adaptive): by prompt lookup, or with a draft model
    (a second copy of the default engine, so drafts are often right and sampled drafts carry their q)."""
    from llmc.runtime.speculative.config import SpeculativeConfig

    cfg = SpeculativeConfig(request.param, num_tokens=4, adaptive=False,
                            draft_model=default_engine if request.param == "draft" else None)
    return Engine.load(default_engine, num_threads=2, speculative=cfg)


def test_greedy_constrained_output_is_the_same_with_speculation(default, speculating):
    """Drafts of constrained requests are cut by the grammar, verified under a mask per position and the
    matcher rolled back: greedy outputs (tokens, logprobs, completeness) equal the plain engine's."""
    prompts, params, checks = _spec_cases(0.0)
    before = speculating.stats()
    outs = speculating.generate(prompts, params)
    plain = default.generate(prompts, params)
    for o, e in zip(outs, plain, strict=True):
        assert o.token_ids == e.token_ids, (o.text, e.text)
        assert (o.finish_reason, o.structured_incomplete, o.structured_error) == (
            e.finish_reason, e.structured_incomplete, e.structured_error)
    for le, ls in zip(plain[1].logprobs, outs[1].logprobs, strict=True):
        assert le.keys() == ls.keys() and np.allclose(list(le.values()), [ls[k] for k in le], atol=1e-4)
    assert _check_outputs(outs, checks) >= 6
    st = speculating.stats()
    assert st.spec_num_accepted_tokens > before.spec_num_accepted_tokens  # drafts were kept


def test_constrained_requests_speculate(default, speculating):
    """Constrained requests alone (no unconstrained neighbour) get drafts, keep some, and stay valid,
    greedy and sampled (sampled drafts of the draft model keep their first forbidden token, which
    rejection sampling replaces)."""
    for temperature in (0.0, 1.0):
        prompts, params, checks = _spec_cases(temperature)
        before = speculating.stats()
        outs = speculating.generate(prompts[:-1], params[:-1])
        st = speculating.stats()
        assert st.spec_num_draft_tokens > before.spec_num_draft_tokens
        assert st.spec_num_accepted_tokens > before.spec_num_accepted_tokens
        assert _check_outputs(outs, checks) >= 5
        for o in outs:
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.token_ids)


def test_filter_draft_cuts_at_the_first_forbidden_token(tiny):
    """Point-mass drafts end before the first token the grammar forbids; sampled ones keep it (for rejection)."""
    rt = tiny.structured
    req = object.__new__(type("R", (), {"__slots__": ("__weakref__",)}))
    rt.attach(req, rt.compiler.compile({"regex": "[0-9]{6}"}))
    tok = rt.compiler.tokenizer.greedy_tokenize
    good, bad = tok("12"), tok("x")
    draft = good + bad + tok("34")
    probs = np.full((len(draft), tiny.vocab_size), 1.0 / tiny.vocab_size)
    assert rt.filter_draft(req, draft, None) == (good, None)
    cut, q = rt.filter_draft(req, draft, probs)
    assert cut == good + bad and q.shape[0] == len(cut)
    assert rt.filter_draft(req, good, None) == (good, None)  # nothing forbidden: unchanged


def test_allows_and_apply_read_the_bitmask_alike(tiny):
    """The greedy shortcut's bit test and the full mask agree on every token, sign bit included."""
    rt = tiny.structured
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=(tiny.vocab_size + 31) // 32).astype(np.int32)
    masked = rt.apply(words, np.zeros(tiny.vocab_size, np.float32), in_place=False)
    assert [rt.allows(words, t) for t in range(tiny.vocab_size)] == list(masked == 0)
    assert 0 < (masked == 0).sum() < tiny.vocab_size
