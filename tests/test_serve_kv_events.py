"""`--kv-events`: a subscriber rebuilds the server's prefix cache from vLLM's KV-event stream alone.

The server (a real socket, the real step loop) publishes on ZeroMQ; the subscriber here decodes the
msgpack batches as llm-d's indexer does (arrays: ``[ts, events, rank]``, events tagged by name), checks
each stored block's hash against the runtime's own chained hash of its tokens, and, after a few hundred
random requests that evict, holds exactly the block set the engine's block manager holds.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import httpx
import pytest

zmq = pytest.importorskip("zmq", reason="--kv-events needs pip install 'llmc[kv-events]'")
msgpack = pytest.importorskip("msgpack")

from llmc.runtime import Engine  # noqa: E402
from llmc.runtime.core.block_manager import hash_block  # noqa: E402
from llmc.serve import ServeConfig, create_app  # noqa: E402
from llmc.serve.kv_events import END_SEQ, attach, batch_events, parse_endpoint  # noqa: E402
from llmc.testing.http_server import serve_app_in_thread  # noqa: E402


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


class _Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: dict[int, bytes] = {}
        self.order: list[int] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b""
                n = int.from_bytes(seq, "big")
                self.order.append(n)
                self.batches[n] = payload
                self.last = time.monotonic()

    def quiet(self, seconds: float = 0.5, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last < seconds and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Batches from ``start`` on, through the replay socket (a DEALER speaks to its ROUTER: [b"", start_seq])."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(0)


def _apply(cached: set[int], payload: bytes, block_size: int) -> None:
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    for ev in events:
        tag = ev[0]
        if tag == "AllBlocksCleared":
            assert len(ev) == 1
            cached.clear()
        elif tag == "BlockStored":
            _, hashes, parent, tokens, size, lora = ev
            assert size == block_size and lora is None and len(tokens) == size * len(hashes)
            for i, h in enumerate(hashes):  # each hash is the runtime's chain over the block's tokens
                parent = hash_block(parent or 0, tokens[i * size : (i + 1) * size])
                assert parent == h
                assert h not in cached
                cached.add(h)
        elif tag == "BlockRemoved":
            assert len(ev) == 2
            for h in ev[1]:
                cached.remove(h)
        else:
            raise AssertionError(f"unknown event {ev!r}")


def test_subscriber_rebuilds_the_cached_block_set(tiny_engine):
    engine = Engine.load(tiny_engine, num_threads=1, kv_cache_tokens=512)  # 32 blocks: requests evict
    config = ServeConfig(model_name="tiny")
    app = create_app(engine, config)
    port = _free_port_pair()
    publisher = attach(app.state.llmc.loop, engine, "127.0.0.1", port)
    sub = _Subscriber(publisher.endpoint)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(16, 80))] for _ in range(6)]
    try:
        with serve_app_in_thread(app, config) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            time.sleep(0.3)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
            for _ in range(240):
                prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": rng.randrange(1, 6),
                                                       "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
            sub.quiet()
            blocks = engine.scheduler.blocks
            assert blocks.evictions > 0, "the workload should evict"
            expected = set(blocks.cached_hashes())
        # Sequence numbers strictly increase; the batch published at attach (seq 0) predates the subscription.
        assert sub.order == sorted(set(sub.order)) and sub.order[-1] == max(sub.batches)
        live = dict(sub.batches)
        skipped = range(5, 15)  # a gap the subscriber "missed"
        for n in skipped:
            live.pop(n, None)
        replayed = dict(_replay(publisher.replay_endpoint, 0))
        assert sorted(replayed) == list(range(max(sub.batches) + 1))
        assert all(replayed[n] == p for n, p in live.items())  # the replay sends the very batches published
        cached: set[int] = set()
        for n in range(max(replayed) + 1):
            _apply(cached, live.get(n, replayed[n]), engine.block_size)
        assert cached == expected
        assert msgpack.unpackb(replayed[0])[1] == [["AllBlocksCleared"]]
        assert len(_replay(publisher.replay_endpoint, max(replayed) - 2)) == 3
    finally:
        sub.close()
        publisher.close()


def test_event_batches_merge_chains_and_endpoints_are_checked():
    raw = [(0, 11, 0, [1, 2]), (0, 12, 11, [3, 4]), (0, 20, 5, [7, 8]), (1, 11, 0, []), (1, 12, 0, [])]
    assert batch_events(raw, 2) == [["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None],
                                    ["BlockStored", [20], 5, [7, 8], 2, None], ["BlockRemoved", [11, 12]]]
    assert parse_endpoint("tcp://0.0.0.0:5557") == ("0.0.0.0", 5557)
    from llmc.errors import LlmcError

    for bad in ("0.0.0.0:5557", "tcp://host", "ipc:///tmp/x"):
        with pytest.raises(LlmcError, match="--kv-events"):
            parse_endpoint(bad)
