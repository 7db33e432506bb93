"""Speculative decoding: exact greedy output, the sampled distribution, rewinds, adaptation, config errors.

Target engines are the tiny random Llama fixtures (random weights loop a lot, so prompt lookup
proposes often); the draft engine for ``method="draft"`` is the other tiny fixture (same tokenizer
and vocabulary, different weights), so drafts are kept sometimes and rejected often: both paths run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.runtime import Engine, SamplingParams
from llmc.runtime.sampling.sampler import sample
from llmc.runtime.speculative.config import SpeculativeConfig
from llmc.runtime.speculative.cost import StepCost, expected_tokens, step_costs
from llmc.runtime.speculative.ngram import NgramIndex, ngram_propose
from llmc.runtime.speculative.speculator import Speculator
from llmc.runtime.speculative.state import SpecState
from llmc.runtime.speculative.verification import accept_or_resample, target_probs, verify

# Chi-square tests run at a false-alarm rate of 1e-4 per test (z below), on seeded generators, so a
# correct sampler fails with probability 1e-4 only if the seed is changed; each test also checks that a
# plausible wrong sampler is caught at the same threshold with the same sample count (the test's power).
Z_1E4 = 3.719  # the standard normal's upper 1e-4 quantile


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Upper quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty; within 2% for df >= 3)."""
    return df * (1.0 - 2.0 / (9 * df) + z * math.sqrt(2.0 / (9 * df))) ** 3


def chi2_goodness(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs``; categories expecting < 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def chi2_homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square statistic over shared categories (pooled where the expected count is < 5)."""
    total = a + b
    na, nb, n = a.sum(), b.sum(), total.sum()
    big = total * min(na, nb) / n >= 5
    rows = np.stack([np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())])
    rows = rows[:, rows.sum(axis=0) > 0]
    exp = rows.sum(axis=1, keepdims=True) * rows.sum(axis=0, keepdims=True) / rows.sum()
    return float(((rows - exp) ** 2 / exp).sum()), rows.shape[1] - 1


# -- the sampler level ------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=7, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
])
def test_target_probs_is_what_sample_draws_from(params):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(0, 2, 64).astype(np.float32)
        ctx = rng.integers(0, 64, 12).tolist()
        seed = int(rng.integers(1 << 30))
        p = target_probs(logits, params, ctx, 5)
        assert sample(logits, params, np.random.default_rng(seed), ctx, 5) == \
            int(np.random.default_rng(seed).choice(p.size, p=p))


@pytest.mark.parametrize("draft_kind", ["point", "distribution"])
def test_rejection_sampling_gives_the_target_distribution(draft_kind):
    """One speculative step, many times: the emitted token follows p, whatever the draft's q."""
    rng = np.random.default_rng(1)
    vocab, n = 8, 40_000
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab) * 0.5)  # far from p, so rejections are common
    counts = np.zeros(vocab, np.int64)
    naive = np.zeros(vocab, np.int64)  # negative control: always keep the draft
    for _ in range(n):
        if draft_kind == "point":
            d = 2  # prompt lookup always proposes the same token here
            tok = accept_or_resample(p, None, d, rng)
        else:
            d = int(rng.choice(vocab, p=q))
            tok = accept_or_resample(p, q, d, rng)
        counts[d if tok is None else tok] += 1
        naive[d] += 1
    stat, df = chi2_goodness(counts, p)
    assert stat < chi2_critical(df), (stat, df, counts, p)
    stat_naive, df_naive = chi2_goodness(naive, p)
    assert stat_naive > chi2_critical(df_naive)  # the test has the power to see a wrong sampler


def test_verify_multi_token_joint_distribution():
    """k = 2 drafts from a draft distribution: the emitted pair follows the target's joint distribution."""
    rng = np.random.default_rng(2)
    vocab, n = 5, 30_000
    logits_rows = rng.normal(0, 1.5, (3, vocab)).astype(np.float32)  # position-wise targets (context-free)
    params = SamplingParams(temperature=1.0)
    p = [target_probs(row, params) for row in logits_rows]
    q = rng.dirichlet(np.ones(vocab), size=2)
    pairs = np.zeros((vocab, vocab), np.int64)
    for _ in range(n):
        d = [int(rng.choice(vocab, p=q[0])), int(rng.choice(vocab, p=q[1]))]
        out = verify(logits_rows, d, q, params, rng, [], 0)
        assert 1 <= len(out) <= 3 and out[: len(out) - 1] == d[: len(out) - 1]
        if len(out) >= 2:
            pairs[out[0], out[1]] += 1
        else:  # the second token would come from the next step, i.e. from the target's row 1
            pairs[out[0], int(rng.choice(vocab, p=p[1]))] += 1
    stat, df = chi2_goodness(pairs.ravel(), np.outer(p[0], p[1]).ravel())
    assert stat < chi2_critical(df), (stat, df)


def test_greedy_verify_keeps_drafts_while_they_are_the_argmax():
    logits = np.full((4, 6), -1.0, np.float32)
    for i, t in enumerate([3, 1, 4, 5]):
        logits[i, t] = 1.0
    g = SamplingParams()
    assert verify(logits, [3, 1, 4], None, g, np.random.default_rng(), [0], 1) == [3, 1, 4, 5]
    assert verify(logits, [3, 2, 4], None, g, np.random.default_rng(), [0], 1) == [3, 1]
    assert verify(logits, [0, 1, 4], None, g, np.random.default_rng(), [0], 1) == [3]


def test_ngram_propose_uses_the_latest_longest_match():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_propose(toks, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    assert ngram_propose(toks, 1, 1, 3) == [7]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram_propose([5, 5], 4, 1, 2) == [5]


def ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup spelled out: for n = max_n .. min_n, the latest earlier n-gram equal to the last one."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_propose_matches_the_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    found = 0
    for _ in range(400):
        toks = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        want = ngram_reference(toks, k, min_n, max_n)
        assert ngram_propose(toks, k, min_n, max_n) == want, (toks, k, min_n, max_n)
        found += bool(want)
    assert 100 < found < 400  # both outcomes were exercised


def linear(per_draft: float, max_k: int = 6) -> list[float]:
    """Step costs relative to a plain step when each draft adds ``per_draft`` of one."""
    return [1.0 + per_draft * k for k in range(max_k + 1)]


def test_adaptation_drops_to_zero_and_probes():
    s = SpecState(max_tokens=6)
    assert s.choose(linear(0.05)) >= 3  # prior acceptance 2/3 and cheap drafts: speculate
    for _ in range(12):
        s.record(4, 0)
    wait = math.ceil(1.8 / SpecState.PROBE_BUDGET)  # a probe of all 6 drafts costs 1.8 steps more than a plain one
    ks = [s.choose(linear(0.3)) for _ in range(wait + 1)]
    assert ks.count(0) == wait and ks.index(6) == wait - 1  # pays no more; one probe after the wait
    for _ in range(20):
        s.record(4, 4)
    assert s.choose(linear(0.1)) == 6
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_failed_probes_back_off_and_a_kept_probe_resets():
    s = SpecState(max_tokens=4)
    for _ in range(12):
        s.record(4, 0)
    costs = linear(0.1, 4)  # a probe of 4 drafts costs 0.4 of a step more: it waits 20 steps at least
    gaps, idle = [], 0
    for _ in range(20 + 32 + 64 + 128 + 5):
        k = s.choose(costs)
        idle += 1
        if k:
            assert k == 4 and s.probing  # a probe proposes all it may: one kept draft could never show a gain
            s.record(4, 0)  # the probe's drafts are rejected
            gaps.append(idle)
            idle = 0
    assert gaps == [20, 32, 64, 128]  # each failed probe doubles the wait
    for _ in range(300):
        if s.choose(costs):
            break
    s.record(4, 4)  # this probe's drafts are kept: speculation pays again
    assert s.choose(linear(0.05, 4)) > 0
    assert s.probe_every == SpecState.PROBE_MIN and not s.probing


def test_kept_probes_that_do_not_pay_back_off_too():
    """A draft model whose drafts are kept 1 time in 2 at batch 8, where a draft costs 0.9 of a step: its probes
    keep their draft half the time, yet speculation never pays, so they grow rarer all the same; and while a
    verify step costs 0.9 of a step more than a plain one, probes wait 0.9 / PROBE_BUDGET steps, not PROBE_MIN."""
    s = SpecState(max_tokens=6, accepted=1.0, rejected=1.0)
    costs = [1.0, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4]  # the first draft dear (0.9 of a step), the rest 0.1 each
    assert s.choose(costs) == 0
    gaps, idle, kept = [], 0, 0
    for _ in range(600):
        k = s.choose(costs)
        idle += 1
        if k:
            assert k == 6
            kept = 1 - kept  # every other probe keeps a draft
            s.record(6, kept)
            gaps.append(idle)
            idle = 0
    wait = math.ceil(1.4 / SpecState.PROBE_BUDGET)  # a probe of 6 drafts costs 1.4 steps more than a plain one
    assert gaps[:4] == [wait - 1, wait, wait, 128]  # kept or not, each probe doubles the wait
    # Where a verify step costs little more than a plain one (prompt lookup at batch 1), probes keep PROBE_MIN.
    s = SpecState(max_tokens=6, accepted=0.0, rejected=4.0)
    assert [s.choose(linear(0.05)) for _ in range(32)] == ([0] * 15 + [6]) * 2


def test_choose_follows_measured_costs_not_a_line():
    s = SpecState(max_tokens=6, accepted=1.0, rejected=1.0)  # acceptance 1/2
    # A 2-token step costs 1.4x (matrix products instead of matrix-vector products), larger ones little more:
    # one draft gains little (1.5 tokens for 1.4x), four most (1.94 tokens for 1.52x).
    assert s.choose([1.0, 1.4, 1.45, 1.5, 1.52, 1.9, 2.3]) == 4
    assert s.choose([1.0, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1]) == 0
    # One draft wins 1.4%, within the margin of plain decode (2%): not worth the noise, so no drafts.
    assert s.choose([1.0, 1.48, 1.75, 1.9, 2.0, 2.2, 2.4]) == 0


def test_step_costs_from_plain_and_verify_fits():
    plain, verify_ = StepCost(refit_every=4), StepCost(refit_every=4)
    assert step_costs(plain, verify_, 1, 3) == pytest.approx([1.0, 1.05, 1.10, 1.15])  # nothing measured: prior
    for _ in range(8):
        plain.observe(1, 0.002)  # plain steps at batch 1 only: 2 ms
        verify_.observe(3, 0.003)  # verify steps of 3 and 5 tokens: 2.25 ms + 0.25 ms per token
        verify_.observe(5, 0.0035)
    costs = step_costs(plain, verify_, 1, 4)
    assert costs == pytest.approx([1.0, 0.00275 / 0.002, 0.0030 / 0.002, 0.00325 / 0.002, 0.0035 / 0.002])
    # Batch 4: plain steps seen at one size only borrow the verify steps' slope (0.25 ms per token).
    assert step_costs(plain, verify_, 4, 1)[1] == pytest.approx(0.00425 / 0.00275)
    # A verify fit below the plain cost (noise) never makes drafts look cheaper than free.
    cheap = StepCost()
    for _ in range(StepCost.MIN_COUNT):
        cheap.observe(2, 0.001)
    assert step_costs(plain, cheap, 1, 2) == [1.0, 1.0, 1.0]


def test_a_stalled_first_verify_step_does_not_price_drafts_out():
    """The first verify step of an engine can stall (ONNX Runtime allocating for a new shape: 30 ms where a
    plain step takes 2): until the verify fit holds MIN_COUNT steps, drafts cost what the plain line says, and
    a probe never waits more than PROBE_MAX steps whatever the costs say."""
    plain, verify_ = StepCost(refit_every=1), StepCost(refit_every=1)
    for n in (1, 2, 3) * 4:
        plain.observe(n, 0.002 + 0.0004 * (n - 1))
    verify_.observe(7, 0.030)
    costs = step_costs(plain, verify_, 1, 2)
    assert costs == pytest.approx([1.0, 1.2, 1.4])
    s = SpecState(max_tokens=2)
    assert s.choose(costs) == 2  # speculation goes on, so the verify fit gets its own steps
    for _ in range(StepCost.MIN_COUNT - 1):
        verify_.observe(7, 0.030)
    stalled = step_costs(plain, verify_, 1, 2)
    assert stalled[1] > 10
    s = SpecState(max_tokens=2, accepted=0.0, rejected=4.0)
    assert [s.choose(stalled) for _ in range(SpecState.PROBE_MAX)].count(2) == 1
    # Three single verify steps of three sizes, the first stalled (11 ms where 0.4 are usual, measured on a
    # 5M-parameter model): no size is trusted yet, so the plain line still prices drafts; a line through the
    # three priced a 7-token step at 57 plain ones, and speculation never started.
    plain, verify_ = StepCost(refit_every=1), StepCost(refit_every=1)
    for _ in range(8):
        plain.observe(1, 0.0004)
    for n, t in ((7, 0.011), (5, 0.0011), (4, 0.0008)):
        verify_.observe(n, t)
    assert not verify_.trusted()
    assert step_costs(plain, verify_, 1, 6)[6] < 1.5
    for _ in range(StepCost.MIN_COUNT):
        verify_.observe(4, 0.0008)
    assert verify_.trusted() and step_costs(plain, verify_, 1, 3)[3] == pytest.approx(2.0)


def test_step_cost_refits_periodically():
    c = StepCost(refit_every=4)
    for n in (1, 2, 3, 4) * 3:
        c.observe(n, 0.001 * n)
    assert c.fit() == pytest.approx((1e-6, 0.001), abs=1e-9)  # a = 0 is floored at 1 us
    for _ in range(3):
        c.observe(10, 1.0)  # not yet refitted: the cached fit stands
    assert c.slope() == pytest.approx(0.001)
    c.observe(10, 1.0)
    assert c.slope() > 0.05


def test_step_cost_fit_ignores_stalls():
    c = StepCost(refit_every=1)
    for _ in range(10):
        c.observe(1, 0.002)
        c.observe(5, 0.003)
    c.observe(5, 0.5)  # one step stalled (another process had the cores): the medians do not move
    c.observe(1, 0.4)
    c.observe(2, 0.3)  # a size seen once, stalled: left out of the line
    assert c.fit() == pytest.approx((0.00175, 0.00025))
    assert c.predict(3) == pytest.approx(0.0025)  # the line between measured sizes
    assert c.predict(1) == pytest.approx(0.002)  # a measured size: its own median


def test_config_errors_name_the_field():
    with pytest.raises(LlmcError, match="SpeculativeConfig.method"):
        SpeculativeConfig("medusa")
    with pytest.raises(LlmcError, match="num_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(LlmcError, match="draft_model"):
        SpeculativeConfig("draft")
    with pytest.raises(LlmcError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(LlmcError, match="--speculative"):
        SpeculativeConfig.parse("draft:")
    assert SpeculativeConfig.parse("draft:/x", 3).draft_model == "/x"


# -- end to end -------------------------------------------------------------------------------------


def _loop_prompts(rng, n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup finds matches at once), of assorted lengths."""
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 500, size=int(rng.integers(3, 9))).tolist()
        tail = rng.integers(3, 500, size=int(rng.integers(1, 30))).tolist()
        out.append(tail + phrase * int(rng.integers(2, 5)))
    return out


def _spec(method: str, draft_dir=None, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method, draft_model=draft_dir if method == "draft" else None, **kw)


@pytest.fixture(params=["ngram", "draft"])
def method(request, tiny_engine):
    """Greedy tests draft with a second copy of the target engine (own KV pool): every draft should be kept,
    so a draft-side KV or rewind bug shows as lost acceptance besides any output difference."""
    return request.param, tiny_engine


def _check_invariants(engine: Engine) -> None:
    """Between steps, no sequence holds a block or a token beyond its own (rewinds returned them)."""
    b, bs = engine._blocks, engine.block_size
    for r in engine.scheduler.running:
        assert b.sequence_tokens(r.seq_id) == r.tokens
        assert len(b.block_table(r.seq_id)) == -(-max(r.num_computed, len(r.tokens) - 1) // bs)
        assert r.num_computed <= len(r.tokens)


def test_greedy_is_identical_single_and_batched(tiny_engine, method):
    name, draft = method
    rng = np.random.default_rng(3)
    prompts = _loop_prompts(rng, 6)
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, logprobs=2 if i % 2 else None,
                             repetition_penalty=1.1 if i == 3 else 1.0)
              for i, m in enumerate(rng.integers(8, 40, size=6))]
    plain = Engine.load(tiny_engine, enable_prefix_caching=False)
    expected = plain.generate(prompts, params)
    spec = Engine.load(tiny_engine, speculative=_spec(name, draft, num_tokens=5, adaptive=False))
    single = [spec.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    reqs = [spec.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]  # batched, stepped by hand
    while spec.has_unfinished():
        spec.step()
        _check_invariants(spec)
    batched = [spec.result(r) for r in reqs]
    for e, s, b in zip(expected, single, batched, strict=True):
        assert s.token_ids == e.token_ids and b.token_ids == e.token_ids
        if e.logprobs is not None:
            for le, ls in zip(e.logprobs, b.logprobs, strict=True):
                assert le.keys() == ls.keys()
                assert np.allclose(list(le.values()), [ls[k] for k in le], atol=1e-4)
    st = spec.stats()
    assert st.spec_num_draft_tokens > 0 and 0 < st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert st.kv_blocks_used == 0 and st.generated_tokens == 2 * sum(len(e.token_ids) for e in expected)
    if name == "draft":
        assert spec.speculator.draft.blocks.num_used_blocks == 0  # draft sequences freed with their requests
        assert st.spec_acceptance_rate > 0.95  # the draft is the target: only float noise can reject


def test_greedy_identical_through_preemption_and_prefix_hits(tiny_engine, method):
    name, draft = method
    rng = np.random.default_rng(4)
    prompts = _loop_prompts(rng, 12)
    prompts += [prompts[0] + prompts[1][:20], prompts[0][:40]]  # prefix-cache hits on computed blocks
    params = [SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[7]) for _ in prompts]
    expected = Engine.load(tiny_engine, enable_prefix_caching=False).generate(prompts, params)
    need = sum(len(p) for p in prompts) + 40 * len(prompts)
    spec = Engine.load(tiny_engine, kv_cache_tokens=need // 3,
                       speculative=_spec(name, draft, num_tokens=4, adaptive=False))
    out = spec.generate(prompts, params)
    assert [o.token_ids for o in out] == [e.token_ids for e in expected]
    assert [o.finish_reason for o in out] == [e.finish_reason for e in expected]
    st = spec.stats()
    assert st.num_preemptions > 0 and st.spec_num_accepted_tokens > 0
    # A second round of the first outputs as prompts hits blocks that were written by verify steps.
    again = [list(o.prompt_token_ids) + list(o.token_ids) for o in out[:4]]
    short = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in again]
    exp2 = Engine.load(tiny_engine, enable_prefix_caching=False).generate(again, short)
    hits_before = spec.stats().cached_prompt_tokens
    assert [o.token_ids for o in spec.generate(again, short)] == [e.token_ids for e in exp2]
    assert spec.stats().cached_prompt_tokens > hits_before
    st = spec.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0
    spec.reset_prefix_cache()
    assert spec.stats().kv_blocks_free == st.kv_blocks_total


def test_opt_out_and_stop_inside_accepted_drafts(tiny_engine):
    """A request opting out never speculates; a stop token among accepted drafts ends the output there."""
    rng = np.random.default_rng(5)
    prompt = _loop_prompts(rng, 1)[0]
    plain = Engine.load(tiny_engine).generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True))[0]
    spec = Engine.load(tiny_engine, speculative=_spec("ngram", num_tokens=6, adaptive=False))
    off = spec.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True, speculative=False))[0]
    assert off.token_ids == plain.token_ids and spec.stats().spec_num_draft_tokens == 0
    for stop_at in range(5, 45, 7):  # stop on a token emitted late in the run, likely inside a verify chunk
        stop = plain.token_ids[stop_at]
        first = plain.token_ids.index(stop)
        got = spec.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True, stop_token_ids=[stop]))[0]
        assert got.token_ids == plain.token_ids[: first + 1] and got.finish_reason == "stop"
        got = spec.generate([prompt], SamplingParams(max_tokens=first + 1, ignore_eos=True))[0]
        assert got.token_ids == plain.token_ids[: first + 1] and got.finish_reason == "length"
    assert spec.stats().spec_num_accepted_tokens > 0


def _plain_and_speculative_agree(target, draft, run, n: int, min_acceptance: float, first_position: int):
    """``run(engine, seed_offset)`` (per-position token counts of ``n`` seeded requests) on the plain engine and on
    the same engine speculating with ``draft`` (3 tokens, not adaptive): both paths ran (drafts verified, some
    kept, some not) and every position passes the two-sample chi-square test. Returns the config and the plain
    counts (positions are numbered from ``first_position`` in failures)."""
    cfg = SpeculativeConfig("draft", 3, draft_model=draft, adaptive=False)
    plain = run(Engine.load(target), 0)
    spec_engine = Engine.load(target, speculative=cfg)
    spec = run(spec_engine, 10_000)
    st = spec_engine.stats()
    assert st.spec_num_draft_tokens > n and min_acceptance < st.spec_acceptance_rate < 0.9, st  # both paths ran
    for pos, (a, b) in enumerate(zip(plain, spec, strict=True)):
        stat, df = chi2_homogeneity(a, b)
        assert df >= 5 and stat < chi2_critical(df), (pos + first_position, stat, df)
    return cfg, plain


def test_sampled_tokens_follow_the_plain_distribution(tiny_engine, tiny_engine_bf16):
    """End to end at temperature 0.4: tokens 2..4 of many seeded requests, speculative vs plain engine.

    The draft is the other tiny model (its distribution differs: about one draft in five is kept), so
    acceptance, residual resampling, bonus tokens, rewinds and batching all run. Both engines draw from
    the same distribution if rejection sampling is right; a two-sample chi-square test per position
    compares them. 600 requests per engine (their tokens pooled into categories expecting >= 5) make a
    shift of a few percent of mass visible: the negative control below, a speculator that keeps every
    draft, is rejected at the same threshold (the temperature concentrates the random model's mass
    enough for ~15 categories per position). (Prompt lookup rarely matches on a random model when
    sampling; its point-mass drafts go through the same ``verify``, tested above at the sampler level.)
    """
    prompt = [5, 17, 33, 41, 5, 17, 33, 41, 5, 17]
    n = 600

    def params(offset):
        return [SamplingParams(max_tokens=4, temperature=0.4, ignore_eos=True, seed=offset + s) for s in range(n)]

    def run(engine, offset):
        outs = engine.generate([prompt] * n, params(offset))
        return [np.bincount([o.token_ids[pos] for o in outs], minlength=engine.vocab_size) for pos in (1, 2, 3)]

    cfg, plain = _plain_and_speculative_agree(tiny_engine, tiny_engine_bf16, run, n, 0.05, first_position=1)
    # Power: keeping every draft (no rejection sampling) shifts the distribution visibly.
    import llmc.runtime.speculative.verification as sp

    original = sp.accept_or_resample
    sp.accept_or_resample = lambda p, q, d, rng: None
    try:
        biased = run(Engine.load(tiny_engine, speculative=cfg), 10_000)
    finally:
        sp.accept_or_resample = original
    assert any(chi2_homogeneity(a, b)[0] > chi2_critical(chi2_homogeneity(a, b)[1])
               for a, b in zip(plain, biased, strict=True))


def test_server_streams_speculative_tokens_and_exports_metrics(tiny_engine):
    """Through the HTTP server: streamed text equals the plain engine's, and the spec counters agree with stats()."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from llmc.serve import ServeConfig
    from llmc.testing.http_server import serve_in_thread

    prompt = _loop_prompts(np.random.default_rng(6), 1)[0]
    plain = Engine.load(tiny_engine).generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    engine = Engine.load(tiny_engine, num_threads=1, speculative=_spec("ngram", num_tokens=5, adaptive=False))
    with serve_in_thread(engine, ServeConfig(model_name="m")) as server:
        body = {"model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        ids: list[int] = []
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        assert ids == plain.token_ids
        text = httpx.get(server.url + "/metrics").text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.labels.get("model_name") == "m"}
    st = engine.stats()
    assert got["llmc:spec_decode_num_draft_tokens_total"] == st.spec_num_draft_tokens > 0
    assert got["llmc:spec_decode_num_accepted_tokens_total"] == st.spec_num_accepted_tokens
    assert got["llmc:spec_decode_num_drafts_total"] == st.spec_num_verify_steps


def test_new_requests_start_from_the_engines_recent_acceptance(tiny_engine):
    """The prior of a new request follows what recent drafts did (here: the draft is the target, all kept)."""
    spec = Engine.load(tiny_engine, speculative=_spec("draft", tiny_engine, num_tokens=4, adaptive=False))
    assert spec.speculator.new_state().acceptance == pytest.approx(2 / 3)  # nothing seen yet: the fixed prior
    prompts = _loop_prompts(np.random.default_rng(5), 3)
    spec.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert spec.stats().spec_acceptance_rate > 0.95
    assert spec.speculator.new_state().acceptance > 0.9


def test_verify_costs_are_kept_per_batch():
    sp = Speculator(SpeculativeConfig("ngram", num_tokens=2), vocab_size=8)
    for _ in range(4):
        sp.observe_step(1, 1, 0.002)  # plain: 2 ms at batch 1, 4 ms at batch 8
        sp.observe_step(8, 8, 0.004)
        sp.observe_step(2, 1, 0.003)  # batch 1: the first draft costs +50% (matrix products from here on)
        sp.observe_step(3, 1, 0.0032)
        sp.observe_step(16, 8, 0.0048)  # batch 8: drafts cost only their own work
        sp.observe_step(24, 8, 0.0056)
    assert sp.verify_fit(1) is not sp.verify_fit(8)
    assert step_costs(sp.plain_cost, sp.verify_fit(1), 1, 2) == pytest.approx([1.0, 1.5, 1.6])
    assert step_costs(sp.plain_cost, sp.verify_fit(8), 8, 2) == pytest.approx([1.0, 1.2, 1.4])
    assert sp.verify_fit(4) is sp.verify_cost  # a batch never seen with drafts: every batch's steps


def test_sampled_constrained_tokens_follow_the_plain_distribution(tiny_engine, tiny_engine_bf16):
    """Constrained (regex ``[a-h]{4}``) sampling with a draft model: the draft samples unconstrained, so most
    of its drafts are forbidden and are rejected under the mask (their replacement drawn from
    ``max(p - q, 0)``), and allowed ones go through the usual acceptance test. Each of the four characters
    must follow the plain constrained engine's distribution (two-sample chi-square per position, 600
    requests each). This checks the plumbing (masks per verified position, rollback, the kept forbidden
    draft): the draft puts only ~3% of its mass on allowed tokens here, so a subtly wrong acceptance rule
    would shift the distribution too little to see; rejection sampling itself, for any target distribution
    (masked ones included), is tested at the sampler level above.
    """
    prompt = [5, 17, 33, 41, 5, 17, 33, 41, 5, 17]
    n = 600
    letters = "abcdefgh"

    def run(engine, offset):
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=offset + s, structured={"regex": "[a-h]{4}"})
                  for s in range(n)]
        outs = engine.generate([prompt] * n, params)
        assert all(o.finish_reason == "stop" and len(o.text) == 4 and set(o.text) <= set(letters) for o in outs)
        return [np.bincount([letters.index(o.text[pos]) for o in outs], minlength=8) for pos in range(4)]

    _plain_and_speculative_agree(tiny_engine, tiny_engine_bf16, run, n, 0.0, first_position=0)



def test_step_cost_fit_is_numpys_weighted_line_through_the_medians():
    """The fit (plain Python, for speed) against np.unique / np.median / np.polyfit on random windows."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        c = StepCost(refit_every=1)
        sizes = rng.choice(np.arange(1, 40), int(rng.integers(1, 5)), replace=False)
        obs = [(int(rng.choice(sizes)), float(rng.random() * 1e-3)) for _ in range(int(rng.integers(1, 40)))]
        for n, t in obs:
            c.observe(n, t)
        x = np.asarray([n for n, _ in obs], np.float64)
        y = np.asarray([t for _, t in obs])
        u, which, counts = np.unique(x, return_inverse=True, return_counts=True)
        med = np.asarray([np.median(y[which == i]) for i in range(u.size)])
        keep = counts >= StepCost.MIN_COUNT
        if keep.any():
            u, med, counts = u[keep], med[keep], counts[keep]
        assert c.trusted() == bool(keep.any())
        if u.size == 1:
            assert c.slope() is None and c.predict(int(u[0])) == pytest.approx(med[0], rel=1e-12)
            continue
        b, a = np.polyfit(u, med, 1, w=counts.astype(np.float64))
        assert c.slope() == pytest.approx(max(b, 0.0), rel=1e-9, abs=1e-15)
        assert c.fit()[0] == pytest.approx(max(a, 1e-6), rel=1e-9, abs=1e-15)


def test_a_request_proposed_for_again_with_nothing_new_gets_the_same_drafts(tiny_engine):
    """A running request that a step did not schedule (its token budget ran out) is proposed for again with no new
    token: the draft engine computes its last token again (it ran a step of no tokens and failed before)."""
    rng = np.random.default_rng(8)
    prompts = _loop_prompts(rng, 3)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = Engine.load(tiny_engine, enable_prefix_caching=False).generate(prompts, params)
    spec = Engine.load(tiny_engine, speculative=_spec("draft", tiny_engine, num_tokens=4, adaptive=False))
    reqs = [spec.submit(p, params) for p in prompts]
    proposed = 0
    while spec.has_unfinished():
        running = spec.scheduler.running
        spec.speculator.propose(running)
        first = [list(r.draft) for r in running]
        spec.speculator.propose(running)
        assert [list(r.draft) for r in running] == first
        proposed += sum(map(len, first))
        spec.step()  # which proposes a third time
        _check_invariants(spec)
    assert [spec.result(r).token_ids for r in reqs] == [e.token_ids for e in expected]
    assert proposed > 0 and spec.speculator.draft.blocks.num_used_blocks == 0


def test_cached_choices_equal_choices_made_afresh():
    """``choose`` caches its last choice (and skips the work while idle): random runs of choices, costs and
    verify outcomes give the same drafts as a twin whose cache is cleared before every choice."""
    rng = np.random.default_rng(11)
    menus = [linear(0.05), linear(0.3), [1.0, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4], linear(0.1), linear(0.6)]
    for _ in range(20):
        cached, fresh = SpecState(max_tokens=6), SpecState(max_tokens=6)
        costs = menus[0]
        chosen = []
        for _ in range(600):
            if rng.random() < 0.02:
                costs = list(menus[int(rng.integers(len(menus)))])  # a refit: new costs, sometimes equal ones
            fresh._chosen_for = None
            k = cached.choose(costs)
            assert fresh.choose(costs) == k
            chosen.append(k)
            if k:
                kept = int(rng.integers(0, k + 1)) if rng.random() < 0.5 else 0
                cached.record(k, kept)
                fresh.record(k, kept)
        assert 0 < sum(map(bool, chosen)) < len(chosen)  # both speculating and idle steps were compared


def test_speculators_swap_on_one_engine_between_requests(tiny_engine):
    """``set_speculator`` changes how later requests speculate (benchmarks compare methods on one engine this
    way); greedy outputs stay the plain ones whichever is in, and it refuses while a request is in the engine."""
    rng = np.random.default_rng(12)
    prompts = _loop_prompts(rng, 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in Engine.load(tiny_engine, enable_prefix_caching=False).generate(prompts, params)]
    e = Engine.load(tiny_engine)
    ngram = e.new_speculator(SpeculativeConfig("ngram", num_tokens=4, adaptive=False))
    draft = e.new_speculator(_spec("draft", tiny_engine, num_tokens=4, adaptive=False))
    assert e.set_speculator(ngram) is None
    for sp in (None, draft, ngram, draft):
        before = e.stats().spec_num_draft_tokens
        e.set_speculator(sp)
        assert [o.token_ids for o in e.generate(prompts, params)] == expected
        assert (e.stats().spec_num_draft_tokens > before) == (sp is not None)
    rid = e.submit(prompts[0], params)
    with pytest.raises(LlmcError, match="set_speculator: requests are in the engine"):
        e.set_speculator(ngram)
    while e.has_unfinished():
        e.step()
    assert e.result(rid).token_ids == expected[0]
    assert e.set_speculator(None) is draft and draft.draft.blocks.num_used_blocks == 0


def test_ngram_index_proposes_what_a_scan_proposes_as_the_sequence_grows():
    """The incremental index against :func:`ngram_propose` (itself checked against a reference above), on random
    sequences of small alphabets (many matches) growing by 1 to 7 tokens a step, as decodes and verify steps do,
    and now and then by 9 to 40 (a prompt, or a request first proposed for late: indexed in bulk)."""
    rng = np.random.default_rng(13)
    checked = found = 0
    for _ in range(60):
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        index = NgramIndex(min_n, max_n)
        toks = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(1, 10))).tolist()
        while len(toks) < 200:
            k = int(rng.integers(0, 7))
            want = ngram_propose(toks, k, min_n, max_n)
            assert index.propose(toks, k) == want, (toks, k, min_n, max_n)
            checked += 1
            found += bool(want)
            grow = int(rng.integers(1, 8)) if rng.random() < 0.8 else int(rng.integers(9, 40))
            toks += rng.integers(0, 8, grow).tolist()
    assert checked > 1000 and 0.2 * checked < found < checked


def test_first_drafts_and_later_drafts_are_priced_apart():
    """Runs of drafts: a request whose 6-draft proposals are all kept one time in five. One rate for all drafts
    says 0.6 and proposes single drafts where a first draft costs 0.3 of a step (1.6 tokens for 1.3x); the first
    draft is kept 1 time in 5 (1.2 tokens for 1.3x), so no drafts pay."""
    s = SpecState(max_tokens=6)
    for _ in range(8):
        for kept in (0, 0, 0, 0, 6):
            s.learn(6, kept)
    assert s.first_acceptance == pytest.approx(0.2, abs=0.1) and s.acceptance > 0.9
    s.probe_every = SpecState.PROBE_MAX
    assert s.choose(linear(0.3)) == 0
    assert s.choose(linear(0.05)) == 6  # cheap drafts: the runs pay (1 + 0.2 * 6 tokens for 1.3x)
    assert expected_tokens(1.0, 3, 0.2) == pytest.approx(1.6)
    assert expected_tokens(0.5, 2, 0.5) == expected_tokens(0.5, 2) == pytest.approx(1.75)


def _decoding_request(seq_id: int, tokens: list[int], max_tokens: int = 500):
    """A request in its decode phase (all but its last token computed), as the scheduler keeps it."""
    from llmc.runtime.core.request import Request

    r = Request(f"r{seq_id}", seq_id, len(tokens), list(tokens), SamplingParams(max_tokens=max_tokens),
                0.0, np.random.default_rng(seq_id))
    r.num_computed = len(tokens) - 1
    return r


def test_prompt_lookup_shadows_resume_drafting_without_probes():
    """An idle prompt-lookup request never probes (its would-be drafts are judged by the tokens that come), and
    drafts again within a few steps of its text starting to repeat."""
    sp = Speculator(SpeculativeConfig("ngram", num_tokens=4), vocab_size=512)
    rng = np.random.default_rng(14)
    r = _decoding_request(0, rng.integers(0, 512, 40).tolist())
    r.spec = sp.new_state()
    for _ in range(10):
        r.spec.learn(4, 0)
    for _ in range(300):  # no repeats: never a draft, no probe either
        sp.propose([r])
        assert not r.draft and not r.spec.probing
        r.tokens.append(int(rng.integers(0, 512)))
        r.num_computed += 1
    assert r.spec.shadow_gap == SpecState.SHADOW_GAP_MAX  # shadows that keep nothing grow rarer
    loop = r.tokens[-12:]  # from now on the text repeats its last 12 tokens
    steps = 0
    while not r.draft:
        r.tokens.append(loop[steps % len(loop)])
        r.num_computed += 1
        steps += 1
        sp.propose([r])
        assert steps < 40
    assert r.draft == [loop[(steps + i) % len(loop)] for i in range(len(r.draft))]
    assert r.spec.shadow_gap == SpecState.SHADOW_GAP


def test_a_closed_batch_drafts_together_or_not_at_all():
    """With no request waiting, a batch runs as long as its longest request: a request whose drafts pay does not
    draft while another's do not. With requests waiting (or alone) it drafts."""
    rng = np.random.default_rng(15)
    sp = Speculator(SpeculativeConfig("ngram", num_tokens=4), vocab_size=512)
    phrase = rng.integers(0, 512, 8).tolist()
    copying = _decoding_request(0, phrase * 4)
    other = _decoding_request(1, rng.integers(0, 512, 40).tolist() + phrase[:3])
    copying.spec, other.spec = sp.new_state(), sp.new_state()
    for _ in range(10):
        copying.spec.learn(4, 4)
        other.spec.learn(4, 0)
    sp.propose([copying, other], waiting=0)
    assert copying.draft == [] and other.draft == []
    sp.propose([copying, other], waiting=2)
    assert copying.draft == phrase[:4] and other.draft == []
    copying.draft = []
    sp.propose([copying], waiting=0)
    assert copying.draft == phrase[:4]
    # New requests draft together only on evidence of their own, not on a prior however good.
    fresh = [_decoding_request(5 + i, phrase * 4) for i in range(2)]
    for r in fresh:
        r.spec = SpecState(max_tokens=4, accepted=30.0, rejected=1.0, index=NgramIndex(1, 4))
    sp.propose(fresh, waiting=0)
    assert [r.draft for r in fresh] == [[], []]
    for r in fresh:
        r.spec.learn(4, 4)
    sp.propose(fresh, waiting=0)
    assert [r.draft for r in fresh] == [phrase[:4], phrase[:4]]


def test_a_sleeping_draft_speculator_probes_when_an_awake_one_does(tiny_engine):
    """While every request of a draft model waits for its probe, proposals are skipped (SLEEP_MAX steps at most)
    and the idle counts caught up on waking: the probes come at the same steps as with a speculator that never
    sleeps, through a request joining and one leaving."""
    def schedule(sleep_max: int) -> list[tuple[int, int]]:
        draft = Engine.load(tiny_engine)
        sp = Speculator(SpeculativeConfig("draft", num_tokens=3, draft_model=tiny_engine), draft.vocab_size, draft)
        sp.SLEEP_MAX = sleep_max
        rng = np.random.default_rng(16)
        running = [_decoding_request(i, rng.integers(3, 200, 20).tolist()) for i in range(2)]
        probes = []
        for step in range(700):
            if step == 150:
                running.append(_decoding_request(2, rng.integers(3, 200, 20).tolist()))
            if step == 400:
                sp.release(running.pop(0))
            for r in running:
                if r.spec is None:
                    r.spec = sp.new_state()
                    for _ in range(6):
                        r.spec.learn(3, 0)
            sp.propose(running, waiting=1)  # requests waiting: each request's own choice
            for r in running:
                if r.draft:
                    probes.append((step, r.seq_id))
                    sp.record(r, len(r.draft), 0)
                    r.draft = []
                r.tokens.append(int(rng.integers(3, 200)))
                r.num_computed += 1
        return probes

    awake = schedule(0)
    assert len(awake) >= 6
    assert schedule(Speculator.SLEEP_MAX) == awake


def test_a_closed_batch_of_draft_requests_sleeps_and_wakes_when_a_queue_forms(tiny_engine):
    """In a closed batch, draft-model requests without evidence of their own draft nothing (and cannot learn while
    idle), so the speculator sleeps; a request queued behind them wakes it, and each request chooses for itself."""
    draft = Engine.load(tiny_engine)
    sp = Speculator(SpeculativeConfig("draft", num_tokens=3, draft_model=tiny_engine), draft.vocab_size, draft)
    rng = np.random.default_rng(17)
    running = [_decoding_request(i, rng.integers(3, 200, 20).tolist()) for i in range(3)]
    for r in running:
        r.spec = sp.new_state()
    skipped = 0
    for _ in range(40):
        before = sp._slept
        sp.propose(running, waiting=0)
        skipped += sp._slept > before
        assert all(not r.draft for r in running)
        for r in running:
            r.tokens.append(int(rng.integers(3, 200)))
            r.num_computed += 1
    assert skipped >= 36  # asleep but for a step every SLEEP_MAX
    sp.propose(running, waiting=2)  # a queue formed: awake, and the prior (2 in 3) says drafts pay
    assert sp._slept == 0 and all(r.draft for r in running)
