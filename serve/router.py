"""Ray Serve request routers for ``llmc serve --replicas N``: prefix-cache aware, round robin, power of two.

A router lives in the ingress process (the ``llmc serve`` front that holds the deployment handle)
and picks a replica for each request. Its inputs:

* the request's **prompt block hashes**: the chained hashes of the prompt's full blocks, computed by
  the ingress with the runtime's own ``hash_block`` (:func:`prompt_block_hashes`), so they are the
  very keys of each replica's prefix cache;
* each replica's **reported cache**: the hashes registered in its block manager, with its queue depth
  and KV usage, which the replica returns from ``record_routing_stats`` (Ray Serve's routing-stats
  path: the controller polls it every ``request_routing_stats_period_s`` and hands it to routers);
* its **own record** of the prompts it sent where since each replica's latest report (a request routed
  a moment ago is not in any report yet, but its blocks will be in that replica's cache when the
  next question on the same document arrives).

Prefix policy (:func:`prefix_choice`, parameters ``imbalance`` and ``recent_keep_s`` of
``PrefixCacheRouter.initialize_state``):

1. the replica holding the longest leading run of the prompt's block hashes wins (ties: the less
   loaded), unless its load (requests this router has in flight there) exceeds the least loaded
   replica's by more than ``imbalance`` requests (default 8): then power of two choices on queue
   length decides (two random replicas; Ray Serve probes their queue lengths and takes the shorter);
2. a prompt no replica holds any block of (a new document) goes to the replica with the smallest
   known cache among those within ``imbalance`` of the least loaded, so that new prefixes spread over
   the replicas' caches instead of piling onto one that would then evict its own working set.

``recent_keep_s`` (default 10 s): how long the router's own record of a routed prompt counts beside
the replica's reports (older ones are in the reports, or were evicted).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from llmc.runtime.core.block_manager import hash_block

ROUTERS: dict[str, type] = {}  # --routing NAME -> router class (filled below)

# Ray Serve pickles this module by value into the process that routes (RequestRouterConfig registers it so):
# module-level state here would be a copy there. What must be shared lives in serve/live_routers.py, imported inside
# the methods.


def prompt_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the blocks of ``tokens`` a prefix cache can serve: full blocks before the last token,
    exactly as the scheduler keys them (runtime/scheduler.py ``_block_hashes``)."""
    out, parent = [], 0
    for i in range((len(tokens) - 1) // block_size):
        parent = hash_block(parent, list(tokens[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def leading_match(hashes: Sequence[int], held) -> int:
    """How many of ``hashes`` (in order) ``held`` contains before the first one it lacks."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


@dataclass
class _Known:
    """What the router believes one replica's prefix cache holds."""

    reported: frozenset[int] = frozenset()
    reported_at: float = 0.0  # the replica's clock when it made the report (time.time())
    recent: dict[int, float] = field(default_factory=dict)  # hash -> when this router sent a prompt with it

    def __contains__(self, h: int) -> bool:
        return h in self.recent or h in self.reported

    def update(self, stats: dict, keep_s: float) -> None:
        at = float(stats.get("time", 0.0))
        if at <= self.reported_at:
            return
        self.reported = frozenset(stats.get("block_hashes", ()))
        self.reported_at = at
        # A prompt sent long enough before the report has been computed (and is in it) or evicted since.
        cutoff = at - keep_s
        self.recent = {h: t for h, t in self.recent.items() if t > cutoff}


def prefix_choice(matches: dict[ReplicaID, int], loads: dict[ReplicaID, int], sizes: dict[ReplicaID, int],
                  imbalance: int) -> ReplicaID | None:
    """The replica the prefix policy sends a request to, or None to fall back to power of two choices.

    ``matches``: leading prompt blocks each candidate holds; ``loads``: requests in flight at each;
    ``sizes``: blocks each is known to cache.
    """
    if not matches:
        return None
    least = min(loads.get(r, 0) for r in matches)
    fair = [r for r in matches if loads.get(r, 0) - least <= imbalance]
    best = max(matches.values())
    if best == 0:  # a new prefix: the smallest cache among the replicas not overloaded
        return min(fair, key=lambda r: (sizes.get(r, 0), loads.get(r, 0), random.random()))
    ties = [r for r, m in matches.items() if m == best]
    pick = min(ties, key=lambda r: loads.get(r, 0))
    return pick if pick in fair else None


class _Tracking:
    """Counts this router's requests in flight per replica and registers the router for the ingress."""

    def _llmc_init(self) -> None:
        self._inflight: dict[ReplicaID, int] = {}
        self._request_replica: dict[str, ReplicaID] = {}
        from llmc.serve.live_routers import register_router

        register_router(self._deployment_id.app_name, self._deployment_id.name, self)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._inflight[replica_id] = self._inflight.get(replica_id, 0) + 1
        self._request_replica[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._request_replica.pop(internal_request_id, None) is not None:
            self._inflight[replica_id] = max(0, self._inflight.get(replica_id, 0) - 1)

    def replica_reports(self) -> dict[str, dict]:
        """Each live replica's latest ``record_routing_stats`` dict, by replica id."""
        return {rid.unique_id: dict(r.routing_stats) for rid, r in self.curr_replicas.items()}

    def load(self, replica_id: ReplicaID) -> int:
        return self._inflight.get(replica_id, 0)


class PrefixCacheRouter(_Tracking, RequestRouter):
    """``--routing prefix`` (the default): see the module docstring."""

    def initialize_state(self, imbalance: int = 8, recent_keep_s: float = 10.0) -> None:
        self._llmc_init()
        self._imbalance = int(imbalance)
        self._keep_s = float(recent_keep_s)
        self._known: dict[ReplicaID, _Known] = {}

    def _view(self, replica: RunningReplica) -> _Known:
        k = self._known.setdefault(replica.replica_id, _Known())
        k.update(replica.routing_stats or {}, self._keep_s)
        return k

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = _hashes_of(pending_request)
        if hashes:
            by_id = {r.replica_id: r for r in candidate_replicas}
            views = {rid: self._view(r) for rid, r in by_id.items()}
            matches = {rid: leading_match(hashes, v) for rid, v in views.items()}
            sizes = {rid: len(v.reported | v.recent.keys()) for rid, v in views.items()}
            pick = prefix_choice(matches, {rid: self.load(rid) for rid in by_id}, sizes, self._imbalance)
            if pick is not None:
                return [[by_id[pick]]]
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        hashes = _hashes_of(pending_request)
        if hashes:
            now = time.time()
            recent = self._known.setdefault(replica_id, _Known()).recent
            for h in hashes:
                recent[h] = now

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._known.pop(replica_id, None)  # a restarted replica starts with an empty cache


class RoundRobinRouter(_Tracking, RequestRouter):
    """``--routing round_robin``: replicas in turn, by replica id (the baseline prefix routing is measured against)."""

    def initialize_state(self) -> None:
        self._llmc_init()
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ordered[next(self._turn) % len(ordered)]]]


class PowerOfTwoRouter(_Tracking, PowerOfTwoChoicesRequestRouter):
    """``--routing pow2``: Ray Serve's own power of two choices on queue length."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self._llmc_init()


def _hashes_of(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None or not pending_request.args:
        return []
    return list(getattr(pending_request.args[0], "block_hashes", ()) or ())


ROUTERS.update(prefix=PrefixCacheRouter, round_robin=RoundRobinRouter, pow2=PowerOfTwoRouter)
