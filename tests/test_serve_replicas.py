"""`llmc serve --replicas 2` on a local Ray instance (ray.init(num_cpus=2)), driven by the real `openai` client.

One Ray instance serves the whole module (Ray's start is the slow part on 2 cores); each deployment is the
default model, two replicas of one ORT thread each, behind the same app a single server runs. Answers are
held to ``Engine.generate`` in this process.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="llmc serve --replicas needs pip install 'llmc[ray]'")

from llmc.runtime import Engine, SamplingParams  # noqa: E402
from llmc.serve import ServeConfig  # noqa: E402
from llmc.serve import replicas as rep  # noqa: E402
from llmc.testing.http_server import serve_app_in_thread  # noqa: E402

MODEL = "default"
KV_TOKENS = 1024  # 64 blocks per replica: 4 of the 7 documents below
PROMPTS = ["The for statement", "def f(x):", "Python's with statement", "A class definition defines"]


@pytest.fixture(scope="module")
def ray_local():
    started = rep.start_ray(rep.ReplicaOptions(num_cpus=2))
    yield
    rep.shutdown(started, timeout=30)


@contextmanager
def replicas(engine, routing: str, kv_cache_tokens: int = KV_TOKENS, kv_events: tuple[str, int] | None = None):
    """Two replicas of ``engine`` behind a server on 127.0.0.1; removed at the end (the 2 CPUs hold two replicas).

    Each deployment is an application of its own name: a process keeps a deployment's router for good."""
    app_name = f"llmc-{routing}-{next(_apps)}"
    opts = rep.ReplicaOptions(replicas=2, routing=routing, stats_period_s=0.2, health_check_period_s=1.0,
                              load_kwargs=dict(num_threads=1, kv_cache_tokens=kv_cache_tokens), app_name=app_name,
                              kv_events=kv_events)
    config = ServeConfig(model_name=MODEL, drain_timeout=5)
    app = rep.create_replicas_app(engine, opts, config)
    try:
        with serve_app_in_thread(app, config) as server:
            server.app_name = app_name
            yield server
    finally:
        from ray import serve

        serve.delete(app_name)


_apps = itertools.count()


@pytest.fixture(scope="module")
def offline(default_engine) -> Engine:
    return Engine.load(default_engine, num_threads=1)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


def _reports(app_name: str, n: int = 2, timeout: float = 30.0) -> dict[str, dict]:
    """The replicas' latest reports, once ``n`` of them have reported."""
    deadline = time.monotonic() + timeout
    while True:
        router = rep.live_router(app_name)
        reports = {k: v for k, v in router.replica_reports().items() if v} if router is not None else {}
        if len(reports) >= n or time.monotonic() > deadline:
            return reports
        time.sleep(0.1)


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1."""
    import socket

    for _ in range(50):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            base = socks[0].getsockname()[1]
            for i, s in enumerate(socks[1:], 1):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _replayed_events(endpoint: str) -> list[list]:
    """Every event a replica's KV-event replay socket still holds (serve/kv_events.py)."""
    import msgpack
    import zmq

    from llmc.serve.kv_events import END_SEQ

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        events = []
        while True:
            assert dealer.poll(5000), endpoint
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return events
            events += msgpack.unpackb(payload)[1]
    finally:
        dealer.close(0)


def test_two_replicas_answer_as_engine_generate_and_survive_a_killed_replica(ray_local, default_engine, offline):
    events_port = _free_ports(4)
    # Round robin: the streams below spread evenly over the two replicas whatever the machine's timing.
    with replicas(default_engine, "round_robin", kv_events=("127.0.0.1", events_port)) as server:
        client = _client(server)
        # Greedy answers through both replicas (the prompts spread over them) equal the engine's own.
        want = [o.token_ids for o in offline.generate(PROMPTS, SamplingParams(max_tokens=12))]
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True}) for p in PROMPTS]
        assert [r.choices[0].model_extra["token_ids"] for r in got] == want
        assert [r.choices[0].text for r in got] == [offline.tokenizer.decode(w) for w in want]
        # Streaming through the replicas: the deltas add up to the same text, then usage.
        for p, w in zip(PROMPTS[:2], want[:2], strict=True):
            chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.tokenizer.decode(w)
            assert chunks[-1].usage.completion_tokens == 12
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(server.url + "/ready").status_code == 200
        # Each replica publishes its own KV events (replica r: PORT + 2r, replay PORT + 2r + 1); both stored blocks.
        for i in range(4):  # prompts of 3+ blocks, two on each replica
            client.completions.create(model=MODEL, prompt=f"{i} " + "for x in range(10): print(x) " * 6, max_tokens=1)
        stored = [sum(e[0] == "BlockStored" for e in _replayed_events(f"tcp://127.0.0.1:{events_port + 2 * r + 1}"))
                  for r in range(2)]
        assert min(stored) > 0, stored
        # The metric names llm-d's endpoint picker reads, beside llmc's, summed over the replicas.
        time.sleep(0.5)  # a routing-stats report after the requests
        metrics = httpx.get(server.url + "/metrics").text
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:cache_config_info", "llmc:generation_tokens_total"):
            assert name in metrics, name
        assert 'num_gpu_blocks="128"' in metrics  # 2 replicas x 64 blocks

        # A client that leaves mid-stream cancels its request on the replica (its engine stops computing it).
        def totals(key: str) -> int:
            return sum(r["stats"][key] for r in _reports(server.app_name).values())

        generated = totals("generated_tokens")
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                next(lines)
            deadline = time.monotonic() + 20
            while not totals("num_running"):  # a report with the request running, then the client leaves
                assert time.monotonic() < deadline
                time.sleep(0.1)
        deadline = time.monotonic() + 20
        while totals("num_running"):
            assert time.monotonic() < deadline, "the abandoned request still runs on its replica"
            time.sleep(0.2)
        time.sleep(0.5)  # one more report
        assert totals("generated_tokens") - generated < 400

        # One replica killed while both stream: its own requests end with an OpenAI error, the others finish.
        reports = _reports(server.app_name)
        assert len(reports) == 2
        victim_id, victim = next(iter(reports.items()))
        router = rep.live_router(server.app_name)
        results: list[object] = [None] * 6
        first = [threading.Event() for _ in results]

        def stream(i: int) -> None:
            try:
                n = 0
                for c in client.completions.create(model=MODEL, prompt=f"{i} {PROMPTS[i % 4]}", max_tokens=400,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    n += len(c.choices[0].text) > 0 if c.choices else 0
                    first[i].set()
                    last = c.choices[0].finish_reason if c.choices else None
                results[i] = ("done", last)
            except openai.APIError as exc:
                results[i] = ("error", exc)
            finally:
                first[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first)
        on_victim = next(n for rid, n in router._inflight.items() if rid.unique_id == victim_id)
        assert 0 < on_victim < len(results), "the streams should be spread over both replicas"
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(120)
        errors = [r[1] for r in results if r[0] == "error"]
        assert [r[1] for r in results if r[0] == "done"] == ["length"] * (len(results) - on_victim)
        assert len(errors) == on_victim
        for exc in errors:  # the error object, not a hang or a truncation reported as a finish
            assert "failed mid-request" in str(exc.message), exc.message

        # Serving goes on: new requests are answered (by the survivor, then by Ray's replacement too).
        again = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True}) for p in PROMPTS]
        assert [r.choices[0].model_extra["token_ids"] for r in again] == want
        assert httpx.get(server.url + "/ready").status_code == 200


def _documents(tokenizer, n: int, length: int) -> list[list[int]]:
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    ids = tokenizer.encode(text)
    assert len(ids) >= n * length
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def _hit_rate(server, workload: list[list[int]]) -> float:
    client = _client(server)
    cached = prompt = 0
    for ids in workload:
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
        cached += r.usage.prompt_tokens_details.cached_tokens
        prompt += r.usage.prompt_tokens
    return cached / prompt


def test_prefix_routing_hits_the_cache_more_than_round_robin(ray_local, default_engine, offline):
    """7 documents of 224 tokens, 5 questions each, interleaved (one question on each document in turn); a replica's
    cache holds 4 documents. Prefix routing keeps each document on one replica; round robin sends every document to
    both, and each replica's cache then cycles through 7 documents with room for 4."""
    docs = _documents(offline.tokenizer, 7, 224)
    workload = [docs[d] + offline.tokenizer.encode(f" Question {q}: what does part {d} say?")
                for q in range(5) for d in range(len(docs))]
    rates = {}
    for routing in ("round_robin", "prefix"):
        with replicas(default_engine, routing) as server:
            rates[routing] = _hit_rate(server, workload)
    print(f"prefix-cache hit rate: {rates}")
    assert rates["prefix"] >= 1.5 * rates["round_robin"], rates
    assert rates["prefix"] > 0.5, rates


def test_plain_serve_and_the_runtime_never_import_ray(tmp_path):
    """Ray stays out of the runtime and of a plain ``llmc serve``; ``--replicas`` without Ray is one line, exit 2."""
    import subprocess
    import sys

    code = ("import sys\nimport llmc.runtime, llmc.serve, llmc.cli.main\nfrom llmc.serve.app import create_app\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'ray'], 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    # Ray made unimportable: the flag names the extra that installs it.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray (test)')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "llmc.cli.main", "serve", "nowhere", "--replicas", "2"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2, r.stderr
    assert "pip install 'llmc[ray]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _running_replicas(app_name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(app_name)
    dep = app.deployments.get(rep.DEPLOYMENT) if app is not None else None
    if dep is None:
        return 0
    return sum(n for state, n in dep.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")


# A short window so the test scales back within seconds; Ray warns that it is shorter than its metrics interval.
@pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")
def test_autoscaling_goes_to_two_replicas_under_load_and_back_without_a_failed_request(ray_local, default_engine,
                                                                                        offline):
    app_name = f"llmc-autoscale-{next(_apps)}"
    # max_num_seqs 2: the target is 1 ongoing request per replica, so 6 concurrent streams ask for more than one.
    opts = rep.ReplicaOptions(autoscale=(1, 2), routing="pow2", stats_period_s=0.2, health_check_period_s=1.0,
                              upscale_delay_s=1.0, downscale_delay_s=2.0, look_back_period_s=2.0, app_name=app_name,
                              load_kwargs=dict(num_threads=1, kv_cache_tokens=KV_TOKENS, max_num_seqs=2))
    config = ServeConfig(model_name=MODEL, drain_timeout=30)
    app = rep.create_replicas_app(default_engine, opts, config)
    want = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=12))[0].text
    try:
        with serve_app_in_thread(app, config) as server:
            client = _client(server)
            assert _running_replicas(app_name) == 1
            stop = threading.Event()
            outcomes: list[str] = []

            def load() -> None:
                while not stop.is_set():
                    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
                    outcomes.append(r.choices[0].text)

            threads = [threading.Thread(target=load) for _ in range(6)]
            for t in threads:
                t.start()
            try:
                deadline = time.monotonic() + 60
                while _running_replicas(app_name) < 2:
                    assert time.monotonic() < deadline, "did not scale up to 2 replicas"
                    time.sleep(0.5)
                time.sleep(2)  # requests on both
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            deadline = time.monotonic() + 60
            while _running_replicas(app_name) > 1:  # idle: one replica is drained and removed
                assert time.monotonic() < deadline, "did not scale back down to 1 replica"
                client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)  # light traffic meanwhile
                time.sleep(0.5)
            # Every request of the run was answered in full (an exception in a load thread leaves it short).
            assert outcomes and set(outcomes) == {want}
            assert all(not t.is_alive() for t in threads)
    finally:
        from ray import serve

        serve.delete(app_name)


def test_prefix_policy_and_prompt_hashes_are_the_block_managers():
    from llmc.runtime.core.block_manager import BlockManager
    from llmc.serve.router import leading_match, prefix_choice, prompt_block_hashes

    a, b = "replica-a", "replica-b"
    assert prefix_choice({a: 3, b: 1}, {a: 2, b: 0}, {a: 9, b: 9}, imbalance=8) == a  # longest match wins
    assert prefix_choice({a: 3, b: 1}, {a: 9, b: 0}, {a: 9, b: 9}, imbalance=8) is None  # overloaded: pow2
    assert prefix_choice({a: 2, b: 2}, {a: 3, b: 1}, {a: 9, b: 9}, imbalance=8) == b  # ties: less loaded
    assert prefix_choice({a: 0, b: 0}, {a: 0, b: 0}, {a: 40, b: 7}, imbalance=8) == b  # new prefix: smallest cache
    # The router's hashes of a prompt are the keys the replica's block manager caches that prompt's blocks under.
    tokens = list(range(100, 171))  # 4 full blocks of 16 and a partial one
    bm = BlockManager(16, 16)
    bm.add_sequence(0, tokens, len(tokens))
    bm.append_slots(0, len(tokens))
    bm.mark_computed(0, len(tokens))
    hashes = prompt_block_hashes(tokens + [5], 16)
    assert len(hashes) == 4 and set(hashes) == set(bm.cached_hashes())
    assert leading_match(prompt_block_hashes(tokens[:40] + [1] * 40, 16), set(bm.cached_hashes())) == 2


@pytest.mark.parametrize(("flags", "needle"), [
    (["--ray-address", "auto"], "--ray-address auto: only with --replicas"),
    (["--autoscale", "3:1"], "--autoscale 3:1: give MIN:MAX"),
    (["--replicas", "0"], "--replicas 0: must be at least 1"),
    (["--kv-events", "localhost:5557"], "--kv-events localhost:5557: give tcp://HOST:PORT"),
    (["--replicas", "2"], "no such engine directory"),  # a missing engine: one line before Ray starts
    (["--replicas", "2", "--lora", "a=b"], "not with --replicas"),
])
def test_replica_flags_are_checked_in_one_line(tmp_path, flags, needle):
    from click.testing import CliRunner

    from llmc.cli.main import cli

    r = CliRunner().invoke(cli, ["serve", str(tmp_path / "nowhere"), *flags])
    assert r.exit_code in (2, 3) and needle in r.output and "Traceback" not in r.output, r.output
