"""``--kv-events tcp://HOST:PORT``: the engine's prefix-cache changes as vLLM's KV-event stream, for external routers.

llm-d's KV-cache indexer and Dynamo's router subscribe to vLLM's stream to learn which blocks each pod
caches; an llmc server that speaks it is routable by them. The wire format (vLLM's ``ZmqEventPublisher``
with msgspec's ``array_like`` structs, as llm-d-kv-cache-manager decodes them):

* a ZeroMQ PUB socket bound at ``tcp://HOST:PORT``; each message is three frames: the topic (``b""``),
  the sequence number (8 bytes, big-endian, from 0, +1 per batch), and the msgpack payload;
* the payload is a ``KVEventBatch`` array ``[ts, [event, ...], data_parallel_rank]`` whose events are
  ``["BlockStored", [block_hash, ...], parent_block_hash | None, [token_id, ...], block_size, lora_id | None]``,
  ``["BlockRemoved", [block_hash, ...]]`` and ``["AllBlocksCleared"]``; the hashes are the engine's own
  64-bit chained block hashes (the ones its prefix cache is keyed by), one per block;
* a ROUTER socket at ``tcp://HOST:PORT+1`` for gaps: a DEALER/REQ client sends ``[b"", start_seq (8 bytes
  big-endian)]`` and receives ``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on, then
  ``[b"", -1 (8 bytes, signed), b""]``.

The first batch after start is ``AllBlocksCleared`` (a subscriber that knew an earlier process of this
server forgets it). Behind ``--replicas`` replica ``r`` (its rank on the node) publishes at
``PORT + 2r`` and replays at ``PORT + 2r + 1``.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from urllib.parse import urlparse

from llmc.errors import LlmcError

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STORED, _REMOVED = 0, 1  # the block manager's event kinds (runtime/csrc/block_manager.cpp)


def parse_endpoint(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ``LlmcError`` naming the flag otherwise."""
    u = urlparse(text)
    if u.scheme != "tcp" or not u.hostname or u.port is None or u.path not in ("", "/"):
        raise LlmcError(f"--kv-events {text}: give tcp://HOST:PORT (e.g. tcp://0.0.0.0:5557); the replay socket "
                        "takes PORT+1")
    return u.hostname, u.port


def _imports():
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise LlmcError(f"--kv-events: needs pyzmq and msgpack ({exc}); install them with "
                        "pip install 'llmc[kv-events]'") from exc
    return zmq, msgpack


def batch_events(raw: list[tuple[int, int, int, list[int]]], block_size: int) -> list[list]:
    """The block manager's events (``drain_events()``) as vLLM's event arrays, consecutive stores of one chain
    and consecutive removals merged as vLLM merges them."""
    out: list[list] = []
    for kind, h, parent, tokens in raw:
        last = out[-1] if out else None
        if kind == _STORED:
            if last is not None and last[0] == "BlockStored" and last[1][-1] == parent:
                last[1].append(h)
                last[3].extend(tokens)
            else:
                out.append(["BlockStored", [h], parent or None, list(tokens), block_size, None])
        elif last is not None and last[0] == "BlockRemoved":
            last[1].append(h)
        else:
            out.append(["BlockRemoved", [h]])
    return out


class KVEventPublisher:
    """Publishes batches on a thread of its own, which owns both sockets (ZeroMQ sockets are single-threaded)."""

    def __init__(self, host: str, port: int, *, buffer_batches: int = 10_000, rank: int = 0) -> None:
        zmq, msgpack = _imports()
        self._zmq = zmq
        self._pack = msgpack.Packer(use_bin_type=True)
        self.rank = rank
        self.endpoint = f"tcp://{host}:{port}"
        self.replay_endpoint = f"tcp://{host}:{port + 1}"
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay = ctx.socket(zmq.ROUTER)
        try:
            self._pub.bind(self.endpoint)
            self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            self._replay.close(0)
            raise LlmcError(f"--kv-events {self.endpoint}: cannot bind it or its replay port {port + 1} "
                            f"({exc}); pick free ports") from exc
        self._queue: queue.Queue[list | None] = queue.Queue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="llmc-kv-events", daemon=True)
        self._thread.start()
        self.publish([["AllBlocksCleared"]])

    def publish(self, events: list[list]) -> None:
        """Queue one batch (thread-safe, returns at once)."""
        if events:
            self._queue.put(events)

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        zmq = self._zmq
        try:
            while True:
                if self._replay.poll(0):
                    self._serve_replay()
                try:
                    events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if events is None:
                    break
                payload = self._pack.pack([time.time(), events, self.rank])
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((b"", seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
        finally:
            self._pub.close(0)
            self._replay.close(0)
            del zmq

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: [identity, b"", start_seq]
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def attach(loop, engine, host: str, port: int, rank: int = 0) -> KVEventPublisher:
    """Publish ``engine``'s cache events after every step of ``loop`` (serve/loop.py's ``EngineLoop``)."""
    publisher = KVEventPublisher(host, port, rank=rank)
    blocks = engine.scheduler.blocks
    blocks.record_events(True)
    block_size = engine.block_size

    def after_step(seconds: float) -> None:  # on the step loop's thread: the only one that changes the block manager
        raw = blocks.drain_events()
        if raw:
            publisher.publish(batch_events(raw, block_size))

    loop.after_step.append(after_step)
    return publisher
