"""The Ray Serve routers alive in this process (``llmc serve --replicas``), by deployment.

A router (serve/router.py) registers itself when its deployment handle makes it; the ingress
(serve/replicas.py) reads the replicas' reports from it (engine counters for /metrics, pool size) without
asking each replica again. Its own module so that both sides import it and neither imports the other: Ray
Serve pickles serve/router.py by value into the routing process, where module-level state would be a copy,
so the shared table lives here and the router imports it inside its methods.
"""

from __future__ import annotations

import threading

APP_NAME = "llmc"  # the Ray Serve application llmc deploys (--replicas)
DEPLOYMENT = "LlmcReplica"  # its deployment of engine replicas

_ROUTERS: dict[str, object] = {}
_ROUTERS_LOCK = threading.Lock()


def register_router(app: str, deployment: str, router) -> None:
    """Record ``router`` as the one of ``app``'s ``deployment`` in this process (the latest made wins)."""
    with _ROUTERS_LOCK:
        _ROUTERS[f"{app}/{deployment}"] = router


def live_router(app: str = APP_NAME, deployment: str = DEPLOYMENT):
    """The router of that deployment's handle in this process (None before its first request)."""
    with _ROUTERS_LOCK:
        return _ROUTERS.get(f"{app}/{deployment}")
