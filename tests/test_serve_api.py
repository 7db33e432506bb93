"""`llmc serve` through the real `openai` client (sync and async, completions and chat, streaming and not).

The server runs on 127.0.0.1 (uvicorn, in a thread); every answer is compared with the same engine
artifact run offline through ``Engine.generate`` in this process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmc.runtime import Engine, SamplingParams
from llmc.serve import ServeConfig
from llmc.testing.http_server import serve_in_thread

MODEL = "tiny"
PROMPTS = ["The for statement", "def f(x):", "Python's with statement"]


@pytest.fixture(scope="module")
def server(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1)
    with serve_in_thread(engine, ServeConfig(model_name=MODEL)) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_engine) -> Engine:
    return Engine.load(tiny_engine, num_threads=1)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat_ids(tiny_engine):
    """transformers' own rendering of a conversation with the engine's template: the reference for chat."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_engine))

    def ids(messages) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    return ids


def _extra(obj, name):
    return (obj.model_extra or {})[name]


def test_completions_greedy_equal_engine_generate(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    ref = offline.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c, r in zip(out.choices, ref, strict=True):
        assert _extra(c, "prompt_token_ids") == r.prompt_token_ids
        assert _extra(c, "token_ids") == r.token_ids and c.text == r.text
        assert c.finish_reason == "length"
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert out.usage.completion_tokens == 36 and out.usage.total_tokens == out.usage.prompt_tokens + 36
    assert out.object == "text_completion" and out.model == MODEL


def test_completions_stream_equals_non_stream_and_usage_chunk(client, offline):
    ref = offline.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [t for c in chunks if c.choices for t in _extra(c.choices[0], "token_ids")] == ref.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_token_id_prompts(client, offline):
    prompts = [[5, 6, 7, 8], [9, 10]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    ref = offline.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [_extra(c, "token_ids") for c in out.choices] == [r.token_ids for r in ref]


def test_chat_greedy_equal_engine_generate_on_the_templated_prompt(client, offline, chat_ids):
    messages = [{"role": "user", "content": "What does the for statement do?"},
                {"role": "assistant", "content": "It loops."}, {"role": "user", "content": "And while?"}]
    ids = chat_ids(messages)
    ref = offline.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    c = out.choices[0]
    assert _extra(c, "prompt_token_ids") == ids
    assert _extra(c, "token_ids") == ref.token_ids and c.message.content == ref.text
    assert c.message.role == "assistant" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_streams_concurrently(server, offline):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)

        async def one(i: int):
            stream = await client.completions.create(model=MODEL, prompt=[3 + i, 4, 5], max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        async def chat():
            r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, temperature=0)
            return r.choices[0].message.content

        try:
            return await asyncio.gather(*(one(i) for i in range(8)), chat())
        finally:
            await client.close()

    texts = asyncio.run(main())
    ref = offline.generate([[3 + i, 4, 5] for i in range(8)], SamplingParams(max_tokens=8, ignore_eos=True))
    assert texts[:8] == [r.text for r in ref]
    assert isinstance(texts[8], str)


def test_n3_with_seed_is_reproducible_and_matches_seeded_engine_runs(client, offline):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, top_p=0.95, n=3, seed=1234,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ids_a = [_extra(c, "token_ids") for c in a.choices]
    assert ids_a == [_extra(c, "token_ids") for c in b.choices]
    assert len({tuple(x) for x in ids_a}) > 1  # the choices are different samples
    ref = offline.generate([PROMPTS[1]] * 3, [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                             seed=1234 + j, ignore_eos=True) for j in range(3)])
    assert ids_a == [r.token_ids for r in ref]
    assert a.usage.completion_tokens == 48 and a.usage.prompt_tokens == len(ref[0].prompt_token_ids)


def test_completion_logprobs_match_engine(client, offline):
    ref = offline.generate(PROMPTS[2], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for i, (tok, d) in enumerate(zip(ref.token_ids, ref.logprobs, strict=True)):
        assert lp.token_logprobs[i] == pytest.approx(d[tok], abs=1e-5)
        top = sorted(d.values(), reverse=True)[:3]
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(top, abs=1e-5)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True})]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    assert [x for c in chunks for x in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_match_engine_in_openai_shape(client, offline, chat_ids):
    messages = [{"role": "user", "content": "for"}]
    ref = offline.generate([chat_ids(messages)], SamplingParams(max_tokens=5, logprobs=2, ignore_eos=True))[0]
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=2, stream=stream, extra_body={"ignore_eos": True})
        content = ([x for ch in r for x in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
                   if stream else r.choices[0].logprobs.content)
        assert len(content) == 5
        for entry, tok, d in zip(content, ref.token_ids, ref.logprobs, strict=True):
            assert entry.logprob == pytest.approx(d[tok], abs=1e-5)
            assert len(entry.top_logprobs) == 2
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(d.values(), reverse=True)[:2],
                                                                            abs=1e-5)
            assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)


def test_usage_counts_cached_prompt_tokens_on_a_repeated_prefix(client, offline):
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 500, size=70).tolist()  # unique to this test: nothing cached yet
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    bs = offline.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // bs * bs > 0
    assert second.usage.prompt_tokens == 70


def test_stop_strings_and_stop_token_ids(client, offline):
    ref = offline.generate(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = ref.text[6:9]
    assert stop and stop.strip()
    expected = offline.generate(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert expected.finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected.text  # the stop string never leaks
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [ref.token_ids[3]],
                                                "return_token_ids": True})
    assert _extra(cut.choices[0], "token_ids") == ref.token_ids[: ref.token_ids.index(ref.token_ids[3]) + 1]


def test_penalties_change_greedy_output_and_top_k_one_is_greedy(client, offline):
    base = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
    greedy = _extra(client.completions.create(temperature=0, **base).choices[0], "token_ids")
    top1 = _extra(client.completions.create(temperature=1.0, seed=3, **{**base, "extra_body": {
        **base["extra_body"], "top_k": 1}}).choices[0], "token_ids")
    assert top1 == greedy
    penalised = _extra(client.completions.create(temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                                                 **base).choices[0], "token_ids")
    ref = offline.generate(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                                      presence_penalty=2.0))[0]
    assert penalised == ref.token_ids
    if len(set(greedy)) < len(greedy):  # the unpenalised output repeats itself: penalties must change it
        assert penalised != greedy


def test_models_tokenize_detokenize(server, offline):
    models = openai.OpenAI(base_url=server.v1, api_key="x").models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "The for statement"}).json()
    assert r["tokens"] == offline.tokenizer.encode("The for statement") and r["count"] == len(r["tokens"])
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == offline.tokenizer.decode(r["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_metrics_parse_and_agree_with_stats(server, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL:
                key = s.name + ("" if "finished_reason" not in s.labels else f"[{s.labels['finished_reason']}]")
                samples[key] = s.value
    stats = server.state.engine.stats()  # idle now: the loop's snapshot is current
    sched = server.state.engine.scheduler.counters
    assert samples["llmc:generation_tokens_total"] == stats.generated_tokens > 0
    assert samples["llmc:num_preemptions_total"] == stats.num_preemptions
    assert samples["llmc:prefix_cache_hits_total"] == stats.cached_prompt_tokens
    assert samples["llmc:prefix_cache_queries_total"] == samples["llmc:prompt_tokens_total"] == \
        sched.admitted_prompt_tokens
    assert samples["llmc:num_requests_running"] == stats.num_running == 0
    assert samples["llmc:num_requests_waiting"] == stats.num_waiting == 0
    assert samples["llmc:kv_cache_usage_perc"] == 0.0 == stats.kv_blocks_used
    finished = sum(v for k, v in samples.items() if k.startswith("llmc:request_success_total"))
    assert samples["llmc:e2e_request_latency_seconds_count"] == finished > 0
    assert samples["llmc:time_to_first_token_seconds_count"] == finished
    assert samples["llmc:request_queue_time_seconds_count"] == finished
    # one inter-token gap per token after the first of every request
    assert samples["llmc:inter_token_latency_seconds_count"] == stats.generated_tokens - finished
    assert math.isfinite(samples["llmc:time_to_first_token_seconds_sum"])


def test_health_and_ready(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200


def test_health_turns_503_when_a_step_hangs_or_the_loop_dies(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1)
    release = threading.Event()
    real_step = engine.step
    mode = {"hang": True}

    def faulty_step():  # fault injection around the real step: hang once, then raise
        if mode["hang"]:
            release.wait(10)
            mode["hang"] = False
            return real_step()
        raise RuntimeError("injected step failure")

    engine.step = faulty_step
    with serve_in_thread(engine, ServeConfig(model_name=MODEL, stall_timeout=0.3)) as s:
        c = openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0, timeout=30)
        assert httpx.get(s.url + "/health").status_code == 200
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.completions.create, model=MODEL, prompt="a", max_tokens=4)
            deadline = time.monotonic() + 10
            while httpx.get(s.url + "/health").status_code == 200:
                assert time.monotonic() < deadline, "health never noticed the hung step"
                time.sleep(0.05)
            r = httpx.get(s.url + "/health")
            assert r.status_code == 503 and "has run for" in r.json()["error"]["message"]
            release.set()
            with pytest.raises(openai.InternalServerError, match="injected step failure"):
                fut.result()
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "died" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/ready").status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert e.value.status_code == 503


def test_a_bug_in_one_request_is_a_500_error_object_and_the_server_goes_on(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1)
    real_submit = engine.submit
    calls = {"n": 0}

    def submit_failing_once(*args, **kwargs):  # fault injection: the engine raises something unexpected once
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected submit failure")
        return real_submit(*args, **kwargs)

    engine.submit = submit_failing_once
    with serve_in_thread(engine, ServeConfig(model_name=MODEL)) as s:
        r = httpx.post(s.v1 + "/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected submit failure" in err["message"]
        assert httpx.get(s.url + "/health").status_code == 200
        ok = httpx.post(s.v1 + "/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
